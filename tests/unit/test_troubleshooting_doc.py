"""docs/troubleshooting.md lists every refusal a user can meet, so it cannot drift from the code.

The refusals are read from the source, not imported (no torch, no megatron): every ``raise
SomeError(<message>)`` and every ``reasons.append(<message>)`` (``megatron-dcp check``'s
refusal table) in the modules of :data:`SOURCES` whose message is a string literal, an f-string,
a ``+`` of them, or a ``SchedulingError`` template. Module-level string constants the message
uses (``DCP_FLAG``, ``BUDGET_FLAG``, ...; in the module or imported from another package module)
are filled in; every other field is a hole. A message's key is its first words: the first piece
of text between holes and cuts (``: ``, ``; ``, ``. ``, `` (``), up to eight words, and the
next one too while the key has fewer than four words. The test asserts that one paragraph
of docs/troubleshooting.md (a list item or a heading; backticks and line breaks ignored) holds
every key's pieces in order, and that each section of :data:`SOURCES` is a heading there.
:data:`EXTRA` holds messages that are not raised as literals (argparse's, the check's verdict).
A message the doc does not list fails with the module, the line and the key to add.
"""

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_dcp"
DOC = REPO / "docs" / "troubleshooting.md"
# Each section of the doc (its heading) and the modules whose refusals it lists.
SOURCES: Dict[str, Tuple[str, ...]] = {
    "Training start-up: DCP flags and the model": (
        "integration/training/entry.py",
        "integration/config.py",
        "integration/model_checks.py",
        "integration/packing_flags.py",
        "integration/node_layout.py",
        "integration/model_cost.py",
        "integration/megatron_import.py",
        "integration/process_groups.py",
        "integration/forward_backward.py",
        "integration/vision_batches.py",
        "integration/patches/cp_switching.py",
        "integration/patches/gdn_switching.py",
        "pretrain_mamba.py",
        "integration/training/vlm_entry.py",
    ),
    "Training start-up: the CPU backend": (
        "integration/cpu/spec_refusals.py",
        "integration/cpu/core_attention.py",
    ),
    "Training start-up: data": (
        "integration/data/datasets.py",
        "integration/data/chat.py",
        "integration/data/conversations.py",
        "integration/data/vlm_samples.py",
        "integration/data/multimodal.py",
        "integration/data/vlm_mock.py",
        "integration/data/vlm_datasets.py",
        "integration/data/indexed.py",
        "integration/data/sft.py",
        "integration/data/lengths.py",
    ),
    "Planning a batch": (
        "scheduling/domain.py",
        "scheduling/dp_balanced.py",
        "scheduling/dynamic_cp/vpp_alignment.py",
        "scheduling/registry.py",
        "scheduling/hardware.py",
        "scheduling/cost.py",
    ),
    "megatron-dcp check": (
        "tools/cli/check.py",
        "tools/check/reference_arm.py",
        "tools/check/reference_records.py",
        "tools/check/planted_defects.py",
    ),
    "megatron-dcp bench-train": (
        "tools/cli/bench_train.py",
        "tools/cli/args.py",
        "tools/bench_train/arms.py",
        "tools/bench_train/stats.py",
        "tools/launcher.py",
        "tools/link/rate.py",
        "tools/link/preflight.py",
        "tools/link/launch.py",
    ),
    "Other commands": (
        "tools/cli/calibrate.py",
        "tools/calibration.py",
        "tools/cli/simulate.py",
        "tools/cli/link_sweep.py",
        "tools/link_sweep/runs.py",
        "tools/cli/replay_refinement.py",
        "tools/refinement_replay.py",
        "tools/workloads.py",
        "tools/plot.py",
    ),
    "The RL adapter (megatron_dcp.adapters)": (
        "adapters/split.py",
        "adapters/merge.py",
        "adapters/loss.py",
        "adapters/heads.py",
        "adapters/value.py",
        "adapters/scores.py",
        "adapters/distill.py",
    ),
    "verl": (
        "integration/megatron_dev_api.py",
        "integration/patches/dev_api.py",
        "integration/patches/__init__.py",
        "integration/patches/verl_critic.py",
        "integration/patches/verl_distill.py",
    ),
}
# Known messages that no literal above raises: argparse's command-line errors (the training
# entry points and every megatron-dcp command), the check's verdict, device_check's last line.
EXTRA = (
    ("startup_errors.py", ("unrecognized arguments",)),
    ("startup_errors.py", ("did you mean",)),
    ("startup_errors.py", ("invalid choice",)),
    ("tools/check/verdict.py", ("megatron-dcp check: FAIL",)),
    ("scripts/device_check.sh", ("device_check: FAIL",)),
    ("integration/data/lengths.py", ("is not a length distribution",)),
    ("integration/data/conversations.py", ("not valid JSON",)),
)
HOLE = None
Piece = Optional[str]  # text of a message, or HOLE for a value filled in at run time
FORMAT_FIELD = re.compile(r"\{[^{}]*\}")
CUT = re.compile(r": |; |\. | \(|\n")


def module_constants(tree: ast.Module) -> Dict[str, str]:
    """The module-level ``NAME = "text"`` assignments of ``tree``."""
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants[target.id] = node.value.value
    return constants


def known_constants(tree: ast.Module) -> Dict[str, str]:
    """The module's string constants and those it imports from other package modules."""
    known: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_dcp."):
            path = PACKAGE.joinpath(*node.module.split(".")[1:])
            source = path.with_suffix(".py") if path.with_suffix(".py").exists() else None
            if source is None:
                continue
            theirs = module_constants(ast.parse(source.read_text()))
            for alias in node.names:
                if alias.name in theirs:
                    known[alias.asname or alias.name] = theirs[alias.name]
    known.update(module_constants(tree))
    return known


def pieces(node: ast.AST, known: Dict[str, str], template: bool) -> Optional[List[Piece]]:
    """The message ``node`` builds as text and holes; None when it is no string expression.
    ``template``: a SchedulingError's ``{parameter}`` fields are holes too."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if not template:
            return [node.value]
        texts = FORMAT_FIELD.split(node.value)
        return [piece for text in texts for piece in (HOLE, text)][1:]
    if isinstance(node, ast.JoinedStr):
        out: List[Piece] = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                out.extend(pieces(value, known, template) or [])
            elif isinstance(value.value, ast.Name) and value.value.id in known:
                out.append(known[value.value.id])
            else:
                out.append(HOLE)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left = pieces(node.left, known, template)
        if isinstance(node.op, ast.Mod):
            return None if left is None else [HOLE if p is None else p for p in left]
        right = pieces(node.right, known, template)
        return None if left is None or right is None else left + right
    return None


def raised_message(node: ast.AST) -> Optional[Tuple[ast.AST, bool]]:
    """The message argument of a ``raise X(...)`` or ``reasons.append(...)``, and whether it is a
    SchedulingError template."""
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
        name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
        return node.exc.args[0], name == "SchedulingError"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        target = node.func.value
        if node.func.attr == "append" and getattr(target, "id", "") == "reasons" and node.args:
            return node.args[0], False
    return None


def segments(text: str) -> List[str]:
    """The words of a piece between its cuts, each at most eight words, no edge marks."""
    out = []
    for segment in CUT.split(text):
        words = segment.strip().strip(":;,.=()[]'\"").split()[:8]
        out.append(" ".join(words).rstrip(":;,.=(['\""))
    return [segment for segment in out if segment]


def key(message: Sequence[Piece]) -> Tuple[str, ...]:
    """The pieces of ``message`` a doc entry must hold, in order (module docstring)."""
    parts: List[str] = []
    for piece in message:
        for segment in segments(piece) if piece else []:
            parts.append(segment)
            if sum(len(part.split()) for part in parts) >= 4 or len(parts) == 2:
                return tuple(parts)
    return tuple(parts)


def refusals(relative: str) -> Iterator[Tuple[int, Tuple[str, ...]]]:
    """(line, key) of each literal refusal of the module ``relative`` (to megatron_dcp/)."""
    tree = ast.parse((PACKAGE / relative).read_text())
    known = known_constants(tree)
    for node in ast.walk(tree):
        found = raised_message(node)
        message = None if found is None else pieces(found[0], known, found[1])
        if message and key(message):
            yield node.lineno, key(message)


def paragraphs(text: str) -> List[str]:
    """The doc's paragraphs: a heading, a list item or a block of lines; backticks dropped and
    white space collapsed."""
    blocks: List[List[str]] = [[]]
    for line in text.splitlines():
        starts = line.startswith(("#", "- ", "* ")) or not line.strip()
        if starts and blocks[-1]:
            blocks.append([])
        if line.strip():
            blocks[-1].append(line)
    return [" ".join(" ".join(block).replace("`", "").split()) for block in blocks if block]


def listed(parts: Sequence[str], blocks: Sequence[str]) -> bool:
    pattern = re.compile(".*?".join(re.escape(" ".join(part.split())) for part in parts))
    return any(pattern.search(block) for block in blocks)


def missing(doc_text: str) -> List[str]:
    """Every refusal of :data:`SOURCES` and :data:`EXTRA` that no paragraph of the doc holds."""
    blocks = paragraphs(doc_text)
    absent = []
    for modules in SOURCES.values():
        for relative in modules:
            for line, parts in refusals(relative):
                if not listed(parts, blocks):
                    absent.append(f"megatron_dcp/{relative}:{line}: {' … '.join(parts)}")
    for where, parts in EXTRA:
        if not listed(parts, blocks):
            absent.append(f"{where}: {' … '.join(parts)}")
    return absent


def test_every_module_of_the_sources_exists_and_raises_something():
    """A module moved or emptied of refusals is seen, not silently skipped."""
    for modules in SOURCES.values():
        for relative in modules:
            assert (PACKAGE / relative).exists(), relative
    counted = [relative for modules in SOURCES.values() for relative in modules]
    silent = [relative for relative in counted if not list(refusals(relative))]
    assert silent == [], silent


def test_every_refusal_has_an_entry_in_the_troubleshooting_doc():
    absent = missing(DOC.read_text())
    assert absent == [], "add to docs/troubleshooting.md:\n" + "\n".join(absent)


def test_each_section_is_a_heading_of_the_doc():
    headings = {line.lstrip("#").strip() for line in DOC.read_text().splitlines()}
    assert [section for section in SOURCES if section not in headings] == []


@pytest.mark.parametrize(
    "removed", ["needs --disable-bias-linear", "check sets these itself", "plan is for"]
)
def test_an_entry_removed_from_the_doc_is_missed(removed):
    """The check can fail: the doc without the paragraphs holding ``removed`` misses an entry."""
    text = DOC.read_text()
    kept = [block for block in text.split("\n\n") if removed not in block.replace("\n", " ")]
    assert len(kept) < len(text.split("\n\n"))
    assert missing("\n\n".join(kept)) != []
