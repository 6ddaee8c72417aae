"""``megatron-dcp bench-train`` on one GPU node: two arms (static CP, DCP) on 2 GPUs with NCCL
and Transformer Engine, timed with CUDA synchronisation (megatron's timers and the DCP busy
clock synchronise before reading the clock). Skipped without 2 GPUs or Transformer Engine."""

import importlib.util
import json

import pytest

from megatron_dcp.tools.launching.local_ranks import cuda_device_count

pytestmark = [
    pytest.mark.skipif(cuda_device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None,
        reason="needs Transformer Engine (scripts/install_gpu.sh)",
    ),
]


def test_two_arms_on_two_gpus(tmp_path):
    from megatron_dcp.tools.cli.bench_train import bench_train

    argv = ["--nproc", "2", "--arms", "static,dcp", "--batches", "4", "--warmup", "1"]
    argv += ["--out", str(tmp_path), "--bf16", "--max-seqlen-per-dp-cp-rank", "2048"]
    assert bench_train(argv) == 0
    result = json.loads((tmp_path / "bench_train.json").read_text())
    assert set(result["summaries"]) == {"static", "dcp"}
    assert all(s["step_ms"] > 0 for s in result["steps"])
