"""``megatron-dcp check`` on GPUs. On 2 GPUs with Transformer Engine (NCCL, bf16, then the
float32 stage): it passes, with DCP's plans mixing CP sizes. On any GPU, at world size 1: the environment report, then one
``error:`` line with the reason (one rank cannot mix CP sizes; and without Transformer Engine,
that too) and exit status 2: what ``scripts/device_check.sh`` runs on one GPU. The checks run
as subprocesses: CUDA is never initialised in the pytest process."""

import importlib.util
import json
import subprocess
import sys

import pytest

from megatron_dcp.tools.launching.local_ranks import cuda_device_count

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def run_check(out, nproc):
    command = [sys.executable, "-m", "megatron_dcp.tools", "check", "--nproc", str(nproc)]
    command += ["--out", str(out), "--json", str(out / "check.json")]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA GPU")
def test_one_gpu_is_refused_with_one_line(tmp_path):
    done = run_check(tmp_path, 1)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("megatron-dcp check: error: --nproc=1: a DP×CP domain of one rank")
    assert ("no Transformer Engine" in line) != HAVE_TE
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["environment"]["devices"]["backend"] == "nccl" and report["refused"] in line


@pytest.mark.skipif(cuda_device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine (scripts/install_gpu.sh)")
def test_two_gpus_pass_in_bf16_then_fp32_with_a_mix_of_cp_sizes(tmp_path):
    """The default on GPUs: a bf16 stage with Transformer Engine, then the float32 stage with
    the reference attention (``tools.check.stages``)."""
    done = run_check(tmp_path, 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("megatron-dcp check: PASS: bf16: ") and "; fp32: " in last
    report = json.loads((tmp_path / "check.json").read_text())
    assert "--bf16" in report["flags"] and report["stages"] == ["bf16", "fp32"]
    low, high = report["layouts"]
    flags = high["training_flags"]
    assert flags[flags.index("--transformer-impl") + 1] == "local" and "--bf16" not in flags
    for layout in (low, high):
        assert any(len(sizes) > 1 for sizes in layout["cp_sizes"]["dcp"])
