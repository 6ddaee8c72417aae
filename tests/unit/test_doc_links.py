"""Every link from one document of the repository to another resolves, anchor included.

The documents are README.md, tests/README.md and docs/*.md. A link is a markdown inline link or
image, ``[text](target)``, outside code (fenced blocks and inline code spans). One without a
scheme (``https:``, ``mailto:``) must name a file or folder inside the repository, relative to
the linking document; its ``#anchor``, where it has one, must be a heading of the markdown file
it names (of the linking document itself for a bare ``#anchor``), as GitHub derives a heading's
anchor: lower case, every character but letters, digits, marks, ``-``, ``_`` and spaces dropped,
spaces turned to ``-``, and ``-1``, ``-2`` ... appended to a repeated one. Nothing is imported
from the package.
"""

import re
import unicodedata
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted(f"docs/{path.name}" for path in (REPO / "docs").glob("*.md"))
DOCUMENTS = ("README.md", "tests/README.md", *DOCS)
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+(?:\([^()\s]*\)[^()\s>]*)*)>?"
                  r"(?:\s+\"[^\"]*\")?\s*\)")  # fmt: skip
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """``(line number, line)`` of every line outside fenced code blocks."""
    fenced = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence and (fenced is None or fence.group(1) == fenced):
            fenced = fence.group(1) if fenced is None else None
            continue
        if fenced is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (before the suffix of a repeated heading)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(
        ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LMN"
    )
    return kept.replace(" ", "-")


def anchors(text: str) -> Set[str]:
    """Every anchor a document has: its headings' (repeats suffixed) and its HTML anchors."""
    found: Set[str] = set(HTML_ANCHOR.findall(text))
    seen: Dict[str, int] = {}
    for _, line in prose_lines(text):
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> Iterator[Tuple[int, str]]:
    """``(line number, target)`` of every inline link or image outside code (a link may wrap
    over lines: code blocks and inline code are blanked, the lines kept)."""
    lines = [""] * len(text.splitlines())
    for number, line in prose_lines(text):
        lines[number - 1] = CODE_SPAN.sub("", line)
    prose = "\n".join(lines)
    for match in LINK.finditer(prose):
        yield prose.count("\n", 0, match.start()) + 1, match.group(1)


def broken(name: str, text: str) -> List[str]:
    """The links of document ``name`` (its text ``text``) that do not resolve, one line each."""
    wrong = []
    here = (REPO / name).parent
    for number, target in links(text):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (here / path).resolve()
        where = f"{name}:{number}: {target}"
        if not path:
            if anchor not in anchors(text):
                wrong.append(f"{where}: no heading #{anchor} in {name}")
        elif REPO not in resolved.parents:
            wrong.append(f"{where}: outside the repository")
        elif not resolved.exists():
            wrong.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            wrong.append(f"{where}: {resolved.relative_to(REPO)} has no heading #{anchor}")
    return wrong


def test_every_link_between_documents_resolves():
    wrong = [line for name in DOCUMENTS for line in broken(name, (REPO / name).read_text())]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("The cap on samples per group (`sample_cap.py`)",
         "the-cap-on-samples-per-group-sample_cappy"),
        ("First on a new machine: `megatron-dcp check`",
         "first-on-a-new-machine-megatron-dcp-check"),
        ("On a GPU: the profile's compute terms against the clock",
         "on-a-gpu-the-profiles-compute-terms-against-the-clock"),
        ("DP × CP — [the domain](x.md)", "dp--cp--the-domain"),
    ],
)  # fmt: skip
def test_slug_is_githubs(heading, expected):
    assert slug(heading) == expected


def test_a_broken_anchor_and_a_missing_file_are_seen():
    """The check can fail: a wrong anchor, a repeated heading's suffix, a heading inside a code
    block, a missing file and a link wrapped over two lines."""
    text = (
        "# Top\n\n## Part\n\n## Part\n\n```text\n## Not a heading\n```\n\n"
        "[a](#part) [b](#part-1) [c](#part-2) [d](#not-a-heading) [e](usage.md#nowhere) "
        "[f](no_such_file.md) `[g](#in-code)` [h](https://example.org/#x)\n"
        "[i](\nusage.md#wrapped)\n"
    )
    wrong = broken("docs/example.md", text)
    assert [line.split(": ")[1] for line in wrong] == [
        "#part-2", "#not-a-heading", "usage.md#nowhere", "no_such_file.md", "usage.md#wrapped",
    ]  # fmt: skip
