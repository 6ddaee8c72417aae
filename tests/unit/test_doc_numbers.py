"""Figures that several documents state agree with one source, docs/numbers.json.

Each entry of :data:`STATEMENTS` is a file, a pattern whose group is the figure as that file
states it (matched with the file's white space collapsed to single spaces), and the key of
docs/numbers.json it must equal. The source's default GPU profile must
be the code's (``DEFAULT_GPU_PROFILE``, read from the source, nothing imported), and every line
of the docs that says which profile is the GPU default must name it. A file that no longer holds
a statement fails too (the statement moved: point the pattern at its new place).
"""

import json
import re
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "docs" / "numbers.json"
HARDWARE = REPO / "megatron_dcp" / "scheduling" / "hardware.py"
DOCS = sorted(f"docs/{path.name}" for path in (REPO / "docs").glob("*.md"))
DOCUMENTS = ("README.md", "tests/README.md", *DOCS)
SWEEP = "bench_links.sh sweep, 2026-11-28, unshaped"
BENCH = "bench_performance.sh, 2026-11-25"
EARLIER = "bench_performance.sh, 2026-11-25, earlier run"
# (file, pattern with one group: the figure, key path in docs/numbers.json)
SPEEDUP = "documents_speedup_2_ranks"
RL = "rl_speedup_2_ranks"
PROFILE = ("default_gpu_profile",)
SUITE, FUNCTIONAL = "suite_minutes", "functional_minutes"
AMD, INTEL = "AMD EPYC, 2026-11-29", "Intel Xeon, 2026-11-28"
PERF = "docs/performance.md"
SHORT = "estimate_short_speedup"
PREDICTED, MEASURED = "predicted (megatron-dcp estimate)", "measured (megatron-dcp bench-train)"
PLAN, LATEST = "plan_time", "2026-11-26, 2-core instance, other core busy, collector paused"
TABLE = "2026-11-24, 2-core instance"
QUOTE = r"which \[gpu\.md\]\(gpu\.md\) and scheduling\.md quote\)"
FIGURE = r"(\d[\d.–-]* m?s)"  # a plan time as the pages write it: "12.9 ms", "0.62–0.71 s"
STATEMENTS: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("README.md", r"tests took (\S+) min on a\s+2-core AMD EPYC", (SUITE, AMD)),
    ("README.md", r"Intel Xeon took (\S+) min on 2026-11-28", (SUITE, INTEL)),
    ("tests/README.md", r"\| 2026-11-29 \| AMD EPYC \| 2,053 \|[^|]+\| (\d+) min", (SUITE, AMD)),
    ("tests/README.md", r"≈ (\d+) min \(AMD EPYC, 2026-11-29\)", (FUNCTIONAL, AMD)),
    ("tests/README.md", r"so functional ≈ (\d+) min there", (FUNCTIONAL, AMD)),
    ("docs/usage.md", r"`cpu-gloo` on the CPU backend, `([\w-]+)` otherwise", PROFILE),
    ("docs/cost_model.md", r"\*\*`([\w-]+)`, the GPU default for training", PROFILE),
    ("docs/cost_model.md", r"`([\w-]+)` \(GPU default\)", PROFILE),
    ("docs/performance.md", r"the GPU default, `([\w-]+)`", PROFILE),
    ("docs/gpu.md", r"default GPU profile is `([\w-]+)`", PROFILE),
    (PERF, r"\| documents \| 2 \| dcp \| [^|]+\| \*\*(1\.\d+)\*\*", (SPEEDUP, BENCH)),
    ("docs/performance.md", r"tie to a small win at 2 ranks: (1\.\d+)×", (SPEEDUP, BENCH)),
    ("docs/performance.md", r"\| documents \| (1\.\d+) \[1\.003", (SPEEDUP, EARLIER)),
    (PERF, r"(1\.\d+)× \[1\.003, 1\.051\] \(the same day's earlier", (SPEEDUP, EARLIER)),
    (PERF, r"\| documents \| unshaped \| 1 \| 2 \|(?: [^|]+ \|){2} (1\.\d+) \[", (SPEEDUP, SWEEP)),
    ("docs/performance.md", r"Over static CP: documents (1\.\d+)× \[0\.990", (SPEEDUP, SWEEP)),
    (PERF, r"(1\.\d+)× \[0\.990, 1\.112\] \(the link-rate sweep", (SPEEDUP, SWEEP)),
    ("docs/gpu.md", r"documents at 2 ranks: (1\.\d+)× \(2026-11-25\)", (SPEEDUP, BENCH)),
    ("docs/gpu.md", r"(1\.\d+)× \(2026-11-28 sweep, unshaped\)", (SPEEDUP, SWEEP)),
    # RL rollouts at 2 ranks: the benchmark's two runs and the sweep, unshaped
    (PERF, r"\| RL rollouts \| 2 \| dcp \| [^|]+\| \*\*(\d\.\d+)\*\*", (RL, BENCH)),
    (PERF, r"\| RL rollouts \| (\d\.\d+) \[", (RL, EARLIER)),
    (PERF, r"\| rl \| unshaped \| 1 \| 2 \|(?: [^|]+ \|){2} (\d\.\d+) \[", (RL, SWEEP)),
    (PERF, r"the CP size anyway, are a tie to a small win at 2 ranks: (\d\.\d+)×", (RL, BENCH)),
    (PERF, r"and (\d\.\d+)× \[0\.978, 1\.019\] \(the earlier run\)", (RL, EARLIER)),
    (PERF, r"(\d\.\d+)× \[1\.020, 1\.095\] \(the link-rate sweep of 2026-11-28", (RL, SWEEP)),
    (PERF, r"RL (\d\.\d+)× \[1\.020, 1\.095\] unshaped", (RL, SWEEP)),
    (PERF, r"\(#results-on-this-machine\), (\d\.\d+)× and", (RL, BENCH)),
    (PERF, r"\(#results-on-this-machine\), \d\.\d+× and (\d\.\d+)×", (RL, EARLIER)),
    ("docs/gpu.md", r"(\d\.\d+)× \(2026-11-28 sweep, unshaped; its interval", (RL, SWEEP)),
    ("docs/gpu.md", r"(\d\.\d+)× and \d\.\d+× \(the benchmark runs of 2026-11-25", (RL, BENCH)),
    ("docs/gpu.md", r"\d\.\d+× and (\d\.\d+)× \(the benchmark runs of 2026-11-25", (RL, EARLIER)),
    # megatron-dcp estimate against bench-train: the "short" data set's speed-up over static CP
    ("docs/estimate.md", r"\| short \| static CP 2 \|(?:[^|]+\|){3} \| \| \| DCP \|(?:[^|]+\|){3} "
     r"(\d\.\d+) / ", (SHORT, PREDICTED)),
    ("docs/estimate.md", r"\| short \| static CP 2 \|(?:[^|]+\|){3} \| \| \| DCP \|(?:[^|]+\|){3} "
     r"\d\.\d+ / (\d\.\d+) \|", (SHORT, MEASURED)),
    ("docs/estimate.md", r"under-predicted on short \((\d\.\d+) predicted", (SHORT, PREDICTED)),
    ("docs/estimate.md", r"predicted against (\d\.\d+) measured\)", (SHORT, MEASURED)),
    ("docs/gpu.md", r"on the short conversations \((\d\.\d+) predicted", (SHORT, PREDICTED)),
    ("docs/gpu.md", r"predicted, (\d\.\d+) measured\)", (SHORT, MEASURED)),
    # plan time, `megatron-dcp benchmark`: the latest runs (2026-11-26) and the table's (2026-11-24)
    ("docs/scaling.md", QUOTE + " " + FIGURE + ",", (PLAN, LATEST, "N = 64")),
    ("docs/scaling.md", QUOTE + r" [^,]+, " + FIGURE + ",", (PLAN, LATEST, "N = 1,024")),
    ("docs/scaling.md", QUOTE + r"(?: [^,]+,){2} " + FIGURE + " and", (PLAN, LATEST, "N = 4,096")),
    ("docs/scaling.md", QUOTE + r"[^(]+ and " + FIGURE + r" \(one", (PLAN, LATEST, "N = 16,384")),
    ("docs/scheduling.md", FIGURE + " at N = 64 with 1024 sequences", (PLAN, LATEST, "N = 64")),
    ("docs/scheduling.md", FIGURE + " at N = 1024 with 16384", (PLAN, LATEST, "N = 1,024")),
    ("docs/scheduling.md", FIGURE + " at N = 4,096 with 65536", (PLAN, LATEST, "N = 4,096")),
    ("docs/gpu.md", FIGURE + " at 64 ranks", (PLAN, LATEST, "N = 64")),
    ("docs/gpu.md", FIGURE + " at 1,024,", (PLAN, LATEST, "N = 1,024")),
    ("docs/gpu.md", FIGURE + " at 4,096,", (PLAN, LATEST, "N = 4,096")),
    ("docs/gpu.md", FIGURE + r" at 16,384 \(one run\)", (PLAN, LATEST, "N = 16,384")),
    ("docs/scaling.md", r"\| 64 \| 1,024 \| " + FIGURE + r" \|", (PLAN, TABLE, "N = 64")),
    ("docs/scaling.md", r"\| 1,024 \| 16,384 \| " + FIGURE + r" \|", (PLAN, TABLE, "N = 1,024")),
    ("docs/scaling.md", r"\| 4,096 \| 65,536 \| " + FIGURE + r" \|", (PLAN, TABLE, "N = 4,096")),
    ("docs/scaling.md", r"\| 16,384 \| 262,144 \| " + FIGURE + " ", (PLAN, TABLE, "N = 16,384")),
)
GPU_DEFAULT_LINE = re.compile(r"GPU default|default GPU")


def source() -> Dict:
    return json.loads(SOURCE.read_text())


def value(numbers: Dict, path: Sequence[str]) -> str:
    for part in path:
        numbers = numbers[part]
    return str(numbers)


def disagreements(texts: Dict[str, str], numbers: Dict) -> List[str]:
    """Each statement of :data:`STATEMENTS` that ``texts`` (file -> text) lacks or states
    otherwise than ``numbers``."""
    wrong = []
    for name, pattern, path in STATEMENTS:
        found = re.findall(pattern, " ".join(texts[name].split()))
        expected = value(numbers, path)
        if not found:
            wrong.append(f"{name}: no statement matches {pattern!r}")
        wrong += [f"{name}: {pattern!r} states {got}, the source {expected}"
                  for got in found if got != expected]
    return wrong


def texts() -> Dict[str, str]:
    return {name: (REPO / name).read_text() for name in DOCUMENTS}


def code_default_gpu_profile() -> str:
    match = re.search(r'^DEFAULT_GPU_PROFILE = "([\w-]+)"', HARDWARE.read_text(), re.M)
    assert match, "DEFAULT_GPU_PROFILE is no longer a string constant in scheduling/hardware.py"
    return match.group(1)


def test_the_source_profile_is_the_codes():
    assert source()["default_gpu_profile"] == code_default_gpu_profile()


def test_every_statement_states_the_sources_figure():
    wrong = disagreements(texts(), source())
    assert wrong == [], "\n".join(wrong)


def test_every_line_naming_the_gpu_default_names_the_sources_profile():
    """A line that says "GPU default" names the profile on it or on a line beside it."""
    profile = source()["default_gpu_profile"]
    wrong = []
    for name, text in texts().items():
        lines = ["", *text.splitlines(), ""]
        for number in range(1, len(lines) - 1):
            near = " ".join(lines[number - 1 : number + 2])
            if GPU_DEFAULT_LINE.search(lines[number]) and profile not in near:
                wrong.append(f"{name}:{number}: {lines[number].strip()}")
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize(
    "path, stale",
    [
        ((SUITE, AMD), "20–25"),
        (("documents_speedup_2_ranks", SWEEP), "1.095"),
        ((RL, SWEEP), "1.06"),
        ((RL, BENCH), "1.000"),
        ((SHORT, PREDICTED), "1.482"),
        ((SHORT, MEASURED), "1.431"),
        ((PLAN, LATEST, "N = 64"), "8.1–8.5 ms"),
        ((PLAN, TABLE, "N = 4,096"), "0.62–0.71 s"),
    ],
)
def test_a_changed_figure_is_seen(path, stale):
    """The check can fail: the source with one figure changed disagrees with the docs."""
    numbers = source()
    inner = numbers
    for part in path[:-1]:
        inner = inner[part]
    inner[path[-1]] = stale
    assert any(stale in line for line in disagreements(texts(), numbers))
