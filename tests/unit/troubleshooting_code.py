"""The code's side of docs/troubleshooting.md's check (the doc's side: ``troubleshooting_page``),
read from the source without importing the package (no torch, no megatron). Used by
tests/unit/test_troubleshooting_doc.py and tests/integration/test_troubleshooting_rendered.py.

The refusals: every ``raise X(<message>)``, ``parser.error(<message>)`` and
``reasons.append(<message>)`` (``megatron-dcp check``'s refusal table) in the modules of
:data:`SOURCES`, the message read as ``troubleshooting_ast`` reads it (text, holes, and the
alternatives of a local name); the call's first positional argument that is a message, or what
one of the module's message builders makes of the call's arguments (``_error(spec, problem)``,
``ConversationError(path, line, reason)``). A message's key (:func:`key`) is its first words,
alternatives read as holes: the first piece of text between holes and cuts (``: ``, ``; ``,
``. ``, `` (``), up to eight words, and the next one too while the key has fewer than four words.

The messages the doc's entries may match (:func:`templates`): those refusals and every
``print(<message>)`` of the same modules, one line of text for each combination of
alternatives, holes marked :data:`HOLE_MARK`.

No module escapes (:func:`escaped`): every module of the package that raises a ``ValueError``
(or a subclass), an ``ArgumentTypeError`` or a ``SystemExit`` with a message that has a key, or
calls ``parser.error`` with one, is in SOURCES or in :data:`INTERNAL`, which says why its
messages are bugs, not refusals.
"""

import ast
import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from troubleshooting_ast import (
    Alt,
    Message,
    call_name,
    expanded,
    holes_for_alternatives,
    in_functions,
    message_of,
    raised_class,
    read_module,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_dcp"
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
        "integration/patches/table.py",
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
        "scheduling/cost_fit.py",
    ),
    "megatron-dcp estimate": (
        "tools/cli/estimate.py",
        "tools/estimate/sources.py",
        "tools/estimate/step_rest.py",
        "tools/estimate/command_line.py",
    ),
    "megatron-dcp check": (
        "tools/cli/check.py",
        "tools/check/reference_arm.py",
        "tools/check/reference_records.py",
        "tools/check/planted_defects.py",
    ),
    "megatron-dcp bench-train": (
        "tools/cli/bench_train.py",
        "tools/bench_train/run.py",
        "tools/bench_train/run_flags.py",
        "tools/argument_types.py",
        "tools/bench_train/arms.py",
        "tools/bench_train/stats.py",
        "tools/launching/training_runs.py",
        "tools/link/rate.py",
        "tools/link/preflight.py",
        "tools/link/launch.py",
    ),
    "Other commands": (
        "tools/cli/calibrate.py",
        "tools/calibration/fit.py",
        "tools/cli/simulate.py",
        "tools/cli/link_sweep.py",
        "tools/link_sweep/runs.py",
        "tools/cli/replay_refinement.py",
        "tools/refinement/replay.py",
        "tools/workloads.py",
        "tools/plot.py",
        "tools/gemm_rate.py",
        "tools/refinement/convergence_bench.py",
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
# Modules that raise ValueErrors no user meets as a refusal, and why: each checks what another
# part of the package hands it, after the checks of SOURCES have passed (a failure is a bug), or
# serves the tests only.
INTERNAL: Dict[str, str] = {
    "integration/cpu/gdn_kernels.py": "the reference kernels, called by megatron's layers",
    "integration/cpu/mamba_kernels.py": "the reference kernels, called by megatron's layers",
    "integration/cpu/hybrid_stack.py": "the packed hybrid stack, fed by the DCP step",
    "runtime/attention.py": "the runtime, fed by the integration layer's checked settings",
    "runtime/exchange.py": "the runtime, fed by the integration layer's checked settings",
    "runtime/groups.py": "the runtime's groups, built by integration/process_groups.py",
    "runtime/pack_padding.py": "pack padding, built by integration/packing_flags.py",
    "runtime/packing.py": "the runtime, fed by the integration layer's checked settings",
    "runtime/routing.py": "the runtime, fed by the integration layer's checked settings",
    "scheduling/model_shape.py": "shapes built from flags and configs checked before",
    "scheduling/plan.py": "a plan breaking its invariants: a bug of the scheduler that made it",
    "scheduling/topology.py": "node layouts, built by integration/node_layout.py",
    "testing/forked_launch.py": "the functional tests' launcher",
    "testing/functional.py": "the functional tests' runner",
    "testing/gpt.py": "the tests' model builder",
    "testing/model_size.py": "the tests' model sizes",
    "testing/oracle.py": "the tests' float64 oracle",
    "tools/launching/local_ranks.py": "the tests' distributed harness",
    "tools/peers/megatron_dev_greedy.py": "a peer planner's failure: the simulator shows n/a",
    "tools/peers/megatron_hybrid_cp.py": "a peer planner's failure: the simulator shows n/a",
}
# Raises in a module of SOURCES that are bugs, not refusals: (module, function).
INTERNAL_RAISES: Set[Tuple[str, str]] = {
    ("integration/patches/table.py", "original_of"),  # asked for a target the patch has not
}
CUT = re.compile(r": |; |\. | \(|\n")
HOLE_MARK = "\x00"  # a hole in a template's text
REFUSAL_BASES = ("ValueError", "ArgumentTypeError", "SystemExit")


# --- the code's messages --------------------------------------------------------------------


def message_call(node: ast.AST) -> Optional[ast.Call]:
    """The call that carries a refusal's message: ``raise X(...)``, ``parser.error(...)``,
    ``reasons.append(...)``."""
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        return node.exc
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    owner = getattr(node.func.value, "id", "")
    if node.func.attr == "append" and owner == "reasons":
        return node
    if node.func.attr == "error" and (owner == "p" or owner.endswith("parser")):
        return node
    return None


def printed_call(node: ast.AST) -> Optional[ast.Call]:
    """A ``print(...)`` call."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "print":
        return node
    return None


@functools.lru_cache(maxsize=None)
def messages(
    source: str, relative: str = "", printed: bool = False
) -> Tuple[Tuple[int, Message], ...]:
    """(line, message) of each refusal of the module source, or with ``printed`` of each
    ``print(<message>)``; the raises of :data:`INTERNAL_RAISES` left out."""
    tree = ast.parse(source)
    scope = read_module(tree)
    skipped = {function for module, function in INTERNAL_RAISES if module == relative}
    found = []
    for node, function in in_functions(tree):
        call = printed_call(node) if printed else message_call(node)
        if call is None or getattr(function, "name", None) in skipped:
            continue
        message = message_of(call, replace(scope, function=function))
        if message:
            found.append((node.lineno, message))
    return tuple(found)


def segments(text: str) -> List[str]:
    """The words of a piece between its cuts, each at most eight words, no edge marks."""
    out = []
    for segment in CUT.split(text):
        words = segment.strip().strip(":;,.=()[]'\"").split()[:8]
        out.append(" ".join(words).rstrip(":;,.=(['\""))
    return [segment for segment in out if segment]


def key(message: Message) -> Tuple[str, ...]:
    """The pieces of ``message`` a doc entry must hold, in order (module docstring)."""
    parts: List[str] = []
    for piece in holes_for_alternatives(message):
        for segment in segments(piece) if piece else []:
            parts.append(segment)
            if sum(len(part.split()) for part in parts) >= 4 or len(parts) == 2:
                return tuple(parts)
    return tuple(parts)


def whole_options(message: Message) -> List[Message]:
    """The messages a message may be when the whole of it is alternatives (a builder's, a
    local name's), else the message itself."""
    if len(message) == 1 and isinstance(message[0], Alt):
        return [whole for option in message[0] for whole in whole_options(option)]
    return [message]


def refusals(relative: str, source: Optional[str] = None) -> Iterator[Tuple[int, Tuple[str, ...]]]:
    """(line, key) of each literal refusal of the module ``relative`` (to megatron_dcp/), or of
    ``source`` read as that module."""
    text = (PACKAGE / relative).read_text() if source is None else source
    for line, message in messages(text, relative):
        keys = {key(option) for option in whole_options(message)}
        for found in sorted(keys - {()}):
            yield line, found


def template_text(message: Sequence[Optional[str]]) -> str:
    """A message as one line, each hole :data:`HOLE_MARK`."""
    text = "".join(HOLE_MARK if piece is None else piece for piece in message)
    return re.sub(f"{HOLE_MARK}+", HOLE_MARK, " ".join(text.split()))


@dataclass(frozen=True)
class Template:
    """A message the code produces: where, and its text (holes :data:`HOLE_MARK`)."""

    where: str  # module:line, or what rendered it
    text: str


def templates(modules: Iterable[str]) -> List[Template]:
    """Every message the ``modules`` raise or print, as :func:`template_text`."""
    found: Dict[str, Template] = {}
    for relative in modules:
        source = (PACKAGE / relative).read_text()
        for printed in (False, True):
            for line, message in messages(source, relative, printed):
                for one in expanded(message):
                    text = template_text(one)
                    found.setdefault(text, Template(f"megatron_dcp/{relative}:{line}", text))
    return list(found.values())


def source_templates() -> List[Template]:
    """Every message of the modules of :data:`SOURCES`."""
    return templates(relative for modules in SOURCES.values() for relative in modules)


# --- no module escapes ----------------------------------------------------------------------


def package_modules() -> Dict[str, ast.Module]:
    return {
        str(path.relative_to(PACKAGE)): ast.parse(path.read_text())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def refusal_classes(trees: Iterable[ast.Module]) -> Set[str]:
    """:data:`REFUSAL_BASES` and the package's classes derived from them."""
    classes = [
        (node.name, {getattr(base, "id", getattr(base, "attr", "")) for base in node.bases})
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]
    found = set(REFUSAL_BASES)
    while True:
        more = {name for name, bases in classes if bases & found} - found
        if not more:
            return found
        found |= more


def raises_refusals(tree: ast.Module, classes: Set[str]) -> bool:
    """Whether the module raises one of ``classes`` or calls ``parser.error`` with a message
    that has a key."""
    scope = read_module(tree)
    for node, function in in_functions(tree):
        call = message_call(node)
        if call is None or call_name(call) == "append":
            continue
        if call_name(call) != "error" and raised_class(call, scope) not in classes:
            continue
        message = message_of(call, replace(scope, function=function))
        if message and any(key(option) for option in whole_options(message)):
            return True
    return False


def escaped(trees: Dict[str, ast.Module]) -> List[str]:
    """The modules of ``trees`` (relative path -> tree) that raise refusals and are neither in
    :data:`SOURCES` nor in :data:`INTERNAL`."""
    classes = refusal_classes(trees.values())
    counted = {m for ms in SOURCES.values() for m in ms} | set(INTERNAL)
    return [
        relative
        for relative, tree in trees.items()
        if relative not in counted and raises_refusals(tree, classes)
    ]
