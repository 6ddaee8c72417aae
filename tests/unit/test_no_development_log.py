"""The documentation, the scripts and the package state what is, not how it came about.

A reader of docs/, scripts/, megatron_dcp/, README.md or tests/README.md has no access to this
project's issue tracker or its working sessions, so no text there may cite them: "issue 41, item
4", "the issue's targets", "a later issue", "this session", "the previous session". An upstream
project's issue stays citable by the project's name right before it ("NVIDIA/nccl issues 391",
"verl issue 123"), as a link, or as "Megatron-LM #5683".
"""

import re
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("docs", "scripts", "megatron_dcp")
FILES = ("README.md", "tests/README.md")
SUFFIXES = (".md", ".py", ".sh", ".json", ".txt", ".toml", ".yaml", ".yml", ".cfg")
# An issue cited by number: allowed only right after an upstream project's name.
NUMBERED = re.compile(r"\bissues?\s+(?:#\s*)?\d+", re.I)
UPSTREAM = re.compile(
    r"(?:\b[\w.-]+/[\w.-]+|\b(?:megatron-lm|megatron-core|megatron|verl|pytorch|torch|nccl|apex"
    r"|transformer engine|transformerengine|flash-attention|flash-attn|github))\s*$",
    re.I,
)
# Phrases that only make sense inside the project's own history.
PHRASES = re.compile(
    r"\b(?:the|this|that|later|earlier|next|previous|last|upcoming|future) issue'?s?\b"
    r"|\b(?:this|that|the previous|previous|an earlier|earlier|last|next|later|other|another) "
    r"sessions?\b",
    re.I,
)


def files() -> List[Path]:
    """Every text file the rule covers."""
    found = [REPO / name for name in FILES]
    for folder in FOLDERS:
        found += sorted(p for p in (REPO / folder).rglob("*") if p.suffix in SUFFIXES)
    return [p for p in found if p.is_file() and "__pycache__" not in p.parts]


def findings(text: str) -> Iterator[Tuple[int, str]]:
    """``(line number, words)`` of every development-log citation in ``text``."""
    for number, line in enumerate(text.splitlines(), 1):
        for match in NUMBERED.finditer(line):
            if not UPSTREAM.search(line[: match.start()]):
                yield number, match.group(0)
        for match in PHRASES.finditer(line):
            yield number, match.group(0)


def test_no_text_cites_the_projects_own_issues_or_sessions():
    wrong = [
        f"{path.relative_to(REPO)}:{number}: {words!r}"
        for path in files()
        for number, words in findings(path.read_text(errors="replace"))
    ]
    assert wrong == [], "rewrite as a plain statement of what is:\n" + "\n".join(wrong)


def test_the_rule_covers_the_documents_scripts_and_package():
    names = {str(path.relative_to(REPO)) for path in files()}
    assert {"README.md", "docs/usage.md", "scripts/device_check.sh"} <= names
    assert "megatron_dcp/tools/cli/main.py" in names


@pytest.mark.parametrize(
    "line",
    [
        "One call on a GPU machine (issue 41, item 4),",
        "prints the table and the issue's targets",
        "DSA under DCP is a later issue: refusing it is the present state",
        "as measured in this session",
        "the previous session's figures",
        "fixed in issue #12",
    ],
)
def test_a_development_log_citation_is_seen(line):
    assert list(findings(line)), line


@pytest.mark.parametrize(
    "line",
    [
        "NCCL's environment variables; NVIDIA/nccl issues 391, 864/986, 1450",
        "as Megatron-LM #5683 reports of dev's scheduler",
        "verl issue 1234 describes the engine's groups",
        "what torch's all_to_all_single issues for each rank",
        "torchrun starts its ranks in sessions of their own",
        "an issue of the upstream tracker",
    ],
)
def test_an_upstream_citation_or_another_sense_is_allowed(line):
    assert list(findings(line)) == [], line
