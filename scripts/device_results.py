"""The results of ``scripts/device_check.sh`` and its verdict: every step's command, exit status,
seconds, output tail and outcome, the probe, the check's report and the GPU tests' counts, in
``OUT/device_check.json``; from the probe, a ready-made cost profile for ``--dcp-cost-profile`` in
``OUT/profile.json``; and, printed last, the one line ``device_check: PASS (...)`` (exit 0) or
``device_check: FAIL: <step>: <why> | ...`` naming every failed step (exit 1).

    python scripts/device_results.py --out DIR [--dry-run]

A step passes when it compared or measured something: ``packages`` exited 0; the ``probe`` exited
0 and left a valid ``probe.json`` (three finite fitted terms, its ring chunks), from which the
profile is built; ``check`` exited 0 with ``passed`` in ``check.json`` (a refusal, exit 2, is a
failure: nothing was compared); ``gpu_tests`` exited 0 and its JUnit XML ``gpu_tests.xml`` counts
at least one passed test and none failed (every test skipped: nothing was compared). A step not
run or timed out fails. A folder with no ``steps/`` or a step file it cannot read: an ``error:``
line and exit 2.

The profile is the cost model of the probe's shape (``scripts/gpu_cost_probe.py``: the default
``ModelShape``, Llama-3-8B-like, on ``h100-eager``, the GPU training default) with its layers'
measured terms: the per-layer micro-batch, linear and quadratic coefficients the probe fitted
replace the profile's per-layer share, times the number of layers (the output head keeps the
profile's figure), and ``cp_efficiency`` is the median of the ring-chunk efficiencies it measured
(at most 1). The K/V exchange and the ring-step latency need two GPUs and keep the profile's
values (its ring step is the one a single H200 measured in eager execution); ``source`` says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Callable, Dict, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_cost_probe, beside this file

from gpu_cost_probe import SHAPE, per_layer_model  # noqa: E402

from megatron_dcp.scheduling.cost import CostModel  # noqa: E402
from megatron_dcp.scheduling.cost_fit import CostProfile, save_profile  # noqa: E402
from megatron_dcp.scheduling.hardware import DEFAULT_GPU_PROFILE, hardware_profile  # noqa: E402

STEPS = ("packages", "probe", "check", "gpu_tests")
TAIL_LINES = 30
# A JUnit test case's child element, and what it makes the case (none of them: passed).
KINDS = (("failure", "failed"), ("error", "errors"), ("skipped", "skipped"))


class InvalidInput(Exception):
    """A file the results are read from is missing or unreadable; the message names it."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A step's judgement: passed, and what it found (passed) or why it failed."""

    passed: bool
    summary: str


def read_step(folder: Path, name: str) -> Dict[str, Any]:
    """One step as the shell script left it (absent files: the step did not run)."""
    def text(suffix: str) -> str:
        path = folder / f"{name}.{suffix}"
        return path.read_text().strip() if path.exists() else ""

    rc, seconds = text("rc"), text("s")
    if not (rc.isdigit() or rc == "") or not (seconds.isdigit() or seconds == ""):
        found = f"{rc!r}, {seconds!r}"
        raise InvalidInput(f"{folder / name}.rc or .s holds {found}: not a whole number")
    return {
        "command": text("cmd"),
        "ran": bool(rc),
        "exit_status": int(rc) if rc else None,
        "timed_out": rc in ("124", "137"),
        "seconds": int(seconds) if seconds else None,
        "output_tail": text("log").splitlines()[-TAIL_LINES:],
    }


def read_json(path: Path) -> Any:
    """The JSON in ``path``; None when there is no such file."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise InvalidInput(f"{path} is not JSON ({error})") from error


def unfinished(step: Dict[str, Any]) -> Optional[str]:
    """Why a step did not finish with exit status 0 (None: it did)."""
    if not step["ran"]:
        return "not run"
    if step["timed_out"]:
        return f"timed out after {step['seconds']} s (exit {step['exit_status']})"
    if step["exit_status"] != 0:
        last = step["output_tail"][-1] if step["output_tail"] else "no output"
        return f"exit {step['exit_status']}: {last}"
    return None


def judge_packages(results: Dict[str, Any], out: Path) -> Outcome:
    """The packages this needs beyond torch are there (or were installed from the wheels)."""
    why = unfinished(results["steps"]["packages"])
    return Outcome(False, why) if why else Outcome(True, "packages ok")


def checked_probe(probe: Any) -> Dict[str, Any]:
    """The probe's JSON, when it holds three finite fitted terms and a list of ring chunks."""
    fit = probe.get("fit") if isinstance(probe, dict) else None
    numbers = isinstance(fit, list) and all(isinstance(x, (int, float)) for x in fit)
    if not (numbers and len(fit) == 3 and all(math.isfinite(x) for x in fit)):
        raise InvalidInput(f"its fit is {fit!r}, not three finite numbers")
    if not isinstance(probe.get("ring_chunks"), list):
        raise InvalidInput("it has no list of ring_chunks")
    return probe


def judge_probe_writing_profile(results: Dict[str, Any], out: Path) -> Outcome:
    """The probe measured: a valid ``probe.json``, from which ``profile.json`` is written."""
    step, path = results["steps"]["probe"], out / "probe.json"
    if results["dry_run"] and not step["ran"]:
        return Outcome(False, "not run (dry run: it needs CUDA)")
    why = unfinished(step)
    if why:
        return Outcome(False, why)
    try:
        probe = read_json(path)
        if probe is None:
            raise InvalidInput("exit 0 but it wrote nothing")
        profile = profile_from_probe(checked_probe(probe))
    except (InvalidInput, ValueError, KeyError, TypeError, ZeroDivisionError) as error:
        return Outcome(False, f"no profile from {path}: {type(error).__name__}: {error}")
    save_profile(str(out / "profile.json"), profile)
    results.update(probe=probe, profile=str(out / "profile.json"))
    return Outcome(True, "probe ok")


def judge_check(results: Dict[str, Any], out: Path) -> Outcome:
    """``check`` compared DCP with static CP and passed; its refusal compared nothing."""
    step = results["steps"]["check"]
    try:
        report = results["check"] = read_json(out / "check.json")
    except InvalidInput as error:
        return Outcome(False, str(error))
    if step["exit_status"] == 2 and isinstance(report, dict) and "refused" in report:
        return Outcome(False, f"refused, nothing compared ({report['refused']})")
    why = unfinished(step)
    if why:
        return Outcome(False, why)
    if not (isinstance(report, dict) and report.get("passed") is True):
        return Outcome(False, f"exit 0 but {out / 'check.json'} does not say it passed")
    return Outcome(True, "check PASS")


def junit_counts(path: Path) -> Dict[str, int]:
    """The passed, failed, errored and skipped test cases in pytest's JUnit XML."""
    if not path.exists():
        raise InvalidInput(f"no {path}")
    try:
        cases = list(ElementTree.parse(path).getroot().iter("testcase"))
    except ElementTree.ParseError as error:
        raise InvalidInput(f"{path} is not XML ({error})") from error
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in cases:
        tags = {child.tag for child in case}
        kind = next((k for t, k in KINDS if t in tags), "passed")
        counts[kind] += 1
    return counts



def judge_gpu_tests(results: Dict[str, Any], out: Path) -> Outcome:
    """The GPU tests ran, none failed, and at least one passed (all skipped: nothing compared)."""
    step = results["steps"]["gpu_tests"]
    if not step["ran"] or step["timed_out"]:
        return Outcome(False, str(unfinished(step)))
    try:
        counts = results["gpu_tests"] = junit_counts(out / "gpu_tests.xml")
    except InvalidInput as error:
        return Outcome(False, f"exit {step['exit_status']}, {error}")
    found = f"{counts['passed']} passed {counts['skipped']} skipped"
    if counts["failed"] or counts["errors"] or step["exit_status"] not in (0, 5):
        problems = f"{counts['failed']} failed {counts['errors']} errors"
        return Outcome(False, f"exit {step['exit_status']}: {problems}, {found}")
    if not counts["passed"]:
        return Outcome(False, f"nothing compared ({found})")
    return Outcome(True, f"gpu tests {found}")


JUDGES: Dict[str, Callable[[Dict[str, Any], Path], Outcome]] = {
    "packages": judge_packages,
    "probe": judge_probe_writing_profile,
    "check": judge_check,
    "gpu_tests": judge_gpu_tests,
}


def verdict_line(outcomes: Dict[str, Outcome]) -> str:
    """``device_check: PASS (...)``, or ``device_check: FAIL: step: why | ...`` naming each."""
    failed = [f"{name}: {o.summary}" for name, o in outcomes.items() if not o.passed]
    if failed:
        return "device_check: FAIL: " + " | ".join(failed)
    return f"device_check: PASS ({', '.join(o.summary for o in outcomes.values())})"


def profile_from_probe(probe: Dict[str, Any]) -> CostProfile:
    """The ready-made profile of the probe's shape (module docstring)."""
    hardware = hardware_profile(DEFAULT_GPU_PROFILE)
    prior, per_layer = CostModel.from_model_shape(SHAPE, hardware), per_layer_model(hardware)
    microbatch, linear, quadratic = probe["fit"]
    layers = SHAPE.num_layers
    efficiencies = [min(1.0, c["whole"] / c["cp"] / c["chunked"]) for c in probe["ring_chunks"]]
    cost = dataclasses.replace(
        prior,
        linear=prior.linear + layers * (linear - per_layer.linear),
        quadratic=prior.quadratic + layers * (quadratic - per_layer.quadratic),
        microbatch=prior.microbatch + layers * (microbatch - per_layer.microbatch),
        cp_efficiency=statistics.median(efficiencies) if efficiencies else prior.cp_efficiency,
        name=f"probe@{probe.get('device', 'gpu')}",
    )
    source = {
        "by": "scripts/device_check.sh (gpu_cost_probe.py)",
        "device": probe.get("device"),
        "measured": "per-layer micro-batch, linear and quadratic terms; cp_efficiency",
        f"kept from {DEFAULT_GPU_PROFILE}": "comm, ring_step (need two GPUs), the head's share",
        "shape": dataclasses.asdict(SHAPE),
    }
    return CostProfile(cost, source)


def results_of(out: Path, dry_run: bool) -> Dict[str, Any]:
    """Every step read from ``out/steps`` and judged, with the verdict line."""
    folder = out / "steps"
    if not folder.is_dir():
        raise InvalidInput(f"no folder {folder}: scripts/device_check.sh writes it")
    results: Dict[str, Any] = {"dry_run": dry_run, "probe": None, "check": None, "gpu_tests": None}
    results["steps"] = {name: read_step(folder, name) for name in STEPS}
    outcomes = {name: judge(results, out) for name, judge in JUDGES.items()}
    for name, outcome in outcomes.items():
        results["steps"][name]["outcome"] = dataclasses.asdict(outcome)
    results["passed"] = all(outcome.passed for outcome in outcomes.values())
    results["verdict"] = verdict_line(outcomes)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="device_check.sh's folder")
    parser.add_argument("--dry-run", action="store_true", help="the probe was left out")
    args = parser.parse_args()
    try:
        results = results_of(args.out, args.dry_run)
    except InvalidInput as error:
        print(f"device_results: error: {error}", file=sys.stderr)
        return 2
    path = args.out / "device_check.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"device_check: results in {path}")
    print(results["verdict"])
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
