"""``scripts/device_check.sh --dry-run`` on CPU: every step recorded in ``device_check.json``
(the probe left out with its command, the check's one-line refusal at world size 1, the GPU
tests skipped), and the ready-made profile ``scripts/device_results.py`` builds from a probe:
known per-layer coefficients come back in the profile, which ``--dcp-cost-profile`` reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.cost_fit import load_profile, save_profile
from megatron_dcp.scheduling.hardware import DEFAULT_GPU_PROFILE, hardware_profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from device_results import profile_from_probe  # noqa: E402
from gpu_cost_probe import SHAPE, per_layer_model  # noqa: E402


def test_dry_run_records_every_step(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--dry-run", "--out", str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "device_check.json").read_text())
    steps = results["steps"]
    assert results["dry_run"] and not steps["probe"]["ran"]
    assert "gpu_cost_probe.py --out" in steps["probe"]["command"]
    assert steps["check"]["exit_status"] == 2
    refusal = steps["check"]["output_tail"][-1]
    assert refusal.startswith("megatron-dcp check: error: --nproc=1: a DP×CP domain of one rank")
    assert results["check"]["refused"] in refusal
    assert results["check"]["environment"]["megatron_core"]["supported"]
    gpu_tests = steps["gpu_tests"]
    assert gpu_tests["exit_status"] == 0 and "skipped" in gpu_tests["output_tail"][-1]
    assert "profile" not in results and not (tmp_path / "profile.json").exists()


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
