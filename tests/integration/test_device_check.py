"""``scripts/device_check.sh`` on CPU. ``--dry-run``: every step recorded in ``device_check.json``
(the probe left out with its command, the check's one-line refusal at world size 1, the GPU tests
skipped) and, since nothing was compared, exit status 1 with a last line naming those three.
``--stubs``: each step replaced by a script with a planted outcome; a planted failure of each
step (a refusal, every GPU test skipped, a probe that wrote nothing...) makes the script exit 1
with a last line naming exactly the failed steps, and all steps passing exits 0 with a PASS line
and a profile. And the ready-made profile ``scripts/device_results.py`` builds from a probe:
known per-layer coefficients come back in the profile, which ``--dcp-cost-profile`` reads."""

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.cost_fit import load_profile, save_profile
from megatron_dcp.scheduling.hardware import DEFAULT_GPU_PROFILE, hardware_profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from device_results import profile_from_probe  # noqa: E402
from gpu_cost_probe import SHAPE, per_layer_model  # noqa: E402

SCRIPT = ROOT / "scripts" / "device_check.sh"
PASSED = '<testcase classname="tests.gpu.test_stub" name="test_one_gpu" time="1.0"/>'
SKIPPED = (
    '<testcase classname="tests.gpu.test_stub" name="test_two_gpus" time="0.0">'
    '<skipped type="pytest.skip" message="needs 2 CUDA GPUs (NCCL)"/></testcase>'
)
FAILED = (
    '<testcase classname="tests.gpu.test_stub" name="test_bf16" time="1.0">'
    '<failure message="assert 0.3 &lt; 0.1">assert 0.3 &lt; 0.1</failure></testcase>'
)


def junit(*cases: str) -> str:
    """pytest's JUnit XML with these test cases."""
    suite = f'<testsuite name="pytest">{"".join(cases)}</testsuite>'
    return f'<?xml version="1.0"?><testsuites>{suite}</testsuites>'


@dataclasses.dataclass
class Stub:
    """A step's stand-in: prints ``says``, writes ``writes`` (when given) to the file the real
    command names last (its output: probe.json, check.json, gpu_tests.xml), exits ``status``."""

    says: str
    status: int = 0
    writes: Optional[str] = None

    def script(self) -> str:
        lines = ["#!/usr/bin/env bash", f"echo {shlex.quote(self.says)}"]
        if self.writes is not None:
            lines.append(f"cat > \"${{@: -1}}\" <<'PLANTED'\n{self.writes}\nPLANTED")
        return "\n".join([*lines, f"exit {self.status}"]) + "\n"


def passing_stubs() -> Dict[str, Stub]:
    """Every step passing: a valid probe (the prior's own per-layer terms), check PASS, one GPU
    test passed and one skipped."""
    layer = per_layer_model(hardware_profile(DEFAULT_GPU_PROFILE))
    chunks = [{"length": 8192, "cp": 2, "whole": 1.0, "chunked": 0.6}]
    probe = {"device": "stub", "fit": [layer.microbatch, layer.linear, layer.quadratic]}
    return {
        "packages": Stub("every package present"),
        "probe": Stub("probe: fitted", writes=json.dumps({**probe, "ring_chunks": chunks})),
        "check": Stub("megatron-dcp check: PASS (stub)", writes=json.dumps({"passed": True})),
        "gpu_tests": Stub("1 passed, 1 skipped", writes=junit(PASSED, SKIPPED)),
    }


def run_device_check(out: Path, stubs: Optional[Dict[str, Stub]] = None, *flags: str):
    """``device_check.sh --out out`` with ``stubs`` written to ``out/../stubs`` and passed."""
    command = ["bash", str(SCRIPT), "--out", str(out), *flags]
    if stubs is not None:
        folder = out.parent / "stubs"
        folder.mkdir(exist_ok=True)
        for path in folder.iterdir():
            path.unlink()
        for name, stub in stubs.items():
            (folder / name).write_text(stub.script())
            (folder / name).chmod(0o755)
        command += ["--stubs", str(folder)]
    return subprocess.run(
        command,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=240,
    )


def failed_steps(done: subprocess.CompletedProcess) -> List[str]:
    """The steps the last line names as failed (it must be a FAIL line, exit status 1)."""
    line = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert line.startswith("device_check: FAIL: "), line
    return [failure.split(":")[0] for failure in line[len("device_check: FAIL: "):].split(" | ")]


def test_dry_run_records_every_step_and_fails_for_want_of_a_comparison(tmp_path):
    done = run_device_check(tmp_path, None, "--dry-run")
    assert failed_steps(done) == ["probe", "check", "gpu_tests"]
    line = done.stdout.strip().splitlines()[-1]
    assert "probe: not run (dry run" in line and "gpu_tests: nothing compared (0 passed" in line
    results = json.loads((tmp_path / "device_check.json").read_text())
    steps = results["steps"]
    assert results["dry_run"] and not steps["probe"]["ran"] and results["verdict"] == line
    assert "gpu_cost_probe.py --out" in steps["probe"]["command"]
    assert steps["packages"]["exit_status"] == 0 and steps["check"]["exit_status"] == 2
    refusal = steps["check"]["output_tail"][-1]
    assert refusal.startswith("megatron-dcp check: error: --nproc=1: a DP×CP domain of one rank")
    assert results["check"]["refused"] in refusal and "check: refused, nothing compared" in line
    assert results["check"]["environment"]["megatron_core"]["supported"]
    gpu_tests = steps["gpu_tests"]
    assert gpu_tests["exit_status"] == 0 and "skipped" in gpu_tests["output_tail"][-1]
    assert results["gpu_tests"]["passed"] == 0 and results["gpu_tests"]["skipped"] > 0
    assert "profile" not in results and not (tmp_path / "profile.json").exists()


def test_every_step_passing_exits_0_with_a_pass_line_and_a_profile(tmp_path):
    out = tmp_path / "out"
    done = run_device_check(out, passing_stubs())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    passes = "packages ok, probe ok, check PASS, gpu tests 1 passed 1 skipped"
    assert line == f"device_check: PASS ({passes})"
    results = json.loads((out / "device_check.json").read_text())
    assert results["passed"] and results["verdict"] == line
    assert load_profile(results["profile"]).cost.name == "probe@stub"
    check = results["steps"]["check"]["command"]  # the stub, given the real command
    assert "-m megatron_dcp.tools check --nproc 1 --out" in check
    assert check.endswith(f"--out {out}/check --json {out}/check.json")
    assert results["steps"]["gpu_tests"]["command"].endswith(f"--junitxml {out}/gpu_tests.xml")


NAN_FIT = json.dumps({"fit": [float("nan"), 1.0, 1.0], "ring_chunks": []})
REFUSAL = "--nproc=1: a DP×CP domain of one rank has CP size 1 only"


CHECK_FAIL = Stub("megatron-dcp check: FAIL (dcp)", 1, json.dumps({"passed": False}))
CHECK_REFUSED = Stub(f"megatron-dcp check: error: {REFUSAL}", 2, json.dumps({"refused": REFUSAL}))
CHECK_SILENT = Stub("megatron-dcp check: PASS (stub)", 0, json.dumps({"passed": False}))
TORCH_MISSING = "ModuleNotFoundError: No module named 'torch'"

# fmt: off
PLANTED_FAILURES = [
    pytest.param("packages", Stub("a package is missing, no wheels/ folder", 1),
                 "exit 1: a package is missing", id="packages-missing"),
    pytest.param("probe", Stub("gpu_cost_probe needs a CUDA GPU", 1),
                 "exit 1: gpu_cost_probe needs a CUDA GPU", id="probe-crashed"),
    pytest.param("probe", Stub("", 124), "timed out after", id="probe-timed-out"),
    pytest.param("probe", Stub("probe: fitted"), "exit 0 but it wrote nothing",
                 id="probe-wrote-nothing"),
    pytest.param("probe", Stub("probe: fitted", writes=NAN_FIT), "not three finite numbers",
                 id="probe-nan-fit"),
    pytest.param("check", CHECK_FAIL, "exit 1: megatron-dcp check: FAIL", id="check-fail"),
    pytest.param("check", CHECK_REFUSED, f"refused, nothing compared ({REFUSAL})",
                 id="check-refused"),
    pytest.param("check", CHECK_SILENT, "does not say it passed", id="check-json-not-passed"),
    pytest.param("gpu_tests", Stub("1 failed", 1, junit(PASSED, FAILED)),
                 "exit 1: 1 failed 0 errors, 1 passed 0 skipped", id="gpu-test-failed"),
    pytest.param("gpu_tests", Stub("2 skipped", 0, junit(SKIPPED, SKIPPED)),
                 "nothing compared (0 passed 2 skipped)", id="gpu-tests-all-skipped"),
    pytest.param("gpu_tests", Stub("INTERNALERROR", 3), "exit 3, no ", id="gpu-tests-no-junit"),
    pytest.param("results", Stub(TORCH_MISSING, 1),
                 f"exited 1 without a verdict ({TORCH_MISSING})", id="results-crashed"),
    pytest.param("results", Stub("device_check: PASS (stub)", 1),
                 "exited 1 without a verdict (device_check: PASS", id="results-pass-with-exit-1"),
]
# fmt: on


@pytest.mark.parametrize("step, stub, why", PLANTED_FAILURES)
def test_a_planted_failure_of_one_step_exits_1_naming_it(tmp_path, step, stub, why):
    done = run_device_check(tmp_path / "out", {**passing_stubs(), step: stub})
    assert failed_steps(done) == [step]
    assert why in done.stdout.strip().splitlines()[-1]


def test_every_failed_step_is_named_and_an_earlier_runs_files_are_not_judged(tmp_path):
    out = tmp_path / "out"
    assert run_device_check(out, passing_stubs()).returncode == 0
    silent = {"probe": Stub("probe: fitted"), "gpu_tests": Stub("collected 0 items", 5, junit())}
    done = run_device_check(out, {**passing_stubs(), **silent})  # probe.json, the XML: stale
    assert failed_steps(done) == ["probe", "gpu_tests"]
    assert done.stdout.strip().endswith("gpu_tests: nothing compared (0 passed 0 skipped)")
    assert not (out / "profile.json").exists()


def test_device_results_refuses_a_folder_the_script_did_not_write(tmp_path):
    results = [sys.executable, str(ROOT / "scripts" / "device_results.py"), "--out"]
    done = subprocess.run([*results, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    error = f"device_results: error: no folder {tmp_path}/steps: scripts/device_check.sh writes it"
    assert done.stderr.strip() == error
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "check.rc").write_text("refused\n")
    done = subprocess.run([*results, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "check.rc or .s holds 'refused'" in done.stderr
    assert not (tmp_path / "device_check.json").exists()


def test_profile_from_a_probe_carries_its_coefficients(tmp_path):
    hardware = hardware_profile(DEFAULT_GPU_PROFILE)  # h100-eager: the GPU training default
    layer = per_layer_model(hardware)
    fit = [2 * layer.microbatch, 3 * layer.linear, 0.5 * layer.quadratic]
    chunks = [{"length": 8192, "cp": c, "whole": 1.0, "chunked": 1.0 / (c * e)}
              for c, e in ((2, 0.9), (4, 0.8), (8, 1.2))]  # fmt: skip
    profile = profile_from_probe({"device": "test", "fit": fit, "ring_chunks": chunks})
    save_profile(str(tmp_path / "profile.json"), profile)
    cost = load_profile(str(tmp_path / "profile.json")).cost
    prior = CostModel.from_model_shape(SHAPE, hardware)
    layers = SHAPE.num_layers
    assert cost.linear == pytest.approx(prior.linear + 2 * layers * layer.linear)
    assert cost.quadratic == pytest.approx(prior.quadratic - 0.5 * layers * layer.quadratic)
    assert cost.microbatch == pytest.approx(prior.microbatch + layers * layer.microbatch)
    assert cost.cp_efficiency == pytest.approx(0.9)  # the median of 0.9, 0.8 and 1.2 capped at 1
    assert (cost.comm, cost.ring_step) == (prior.comm, prior.ring_step)
