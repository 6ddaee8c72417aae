"""``megatron_dcp.pretrain_gpt`` end to end on real (indexed) data: documents of a megatron
indexed dataset, one per sample, through 2 CPU ranks (CP2) for a few iterations with evaluation;
and with sequence parallelism and the distributed optimizer (tp2·cp2, 4 CPU ranks). Each run
trained the model its flags ask for (megatron's parameter count against ``testing.model_size``)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing.functional import forked
from megatron_dcp.testing.model_size import check_model_size
from megatron_dcp.tools.launching.training_runs import flag_list, run_pretrain

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")


def write_documents(prefix: Path, count: int, seed: int = 0) -> str:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(count):
        length = int(rng.integers(2, 300))
        builder.add_document(rng.integers(1, 128, length).astype(np.int32), [length])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def indexed_run_options(tmp_path, documents: int, **overrides) -> dict:
    """A tiny CP2 DCP run over indexed documents with evaluation (flag -> value)."""
    options = {
        "--dynamic-context-parallel": True,
        "--context-parallel-size": 2,
        "--max-seqlen-per-dp-cp-rank": 128,
        "--num-layers": 2,
        "--hidden-size": 32,
        "--num-attention-heads": 4,
        "--seq-length": 256,
        "--max-position-embeddings": 256,
        "--micro-batch-size": 1,
        "--global-batch-size": 6,
        "--train-iters": 3,
        "--eval-iters": 1,
        "--eval-interval": 3,
        "--lr": 1e-3,
        "--tokenizer-type": "NullTokenizer",
        "--vocab-size": 128,
        "--data-path": write_documents(tmp_path / "corpus", documents),
        "--split": "80,10,10",
        "--log-interval": 1,
    }
    return {**options, **overrides}


def test_training_on_indexed_documents(tmp_path):
    options = indexed_run_options(tmp_path, 60)
    log = run_pretrain(flag_list(options), 2, tmp_path / "run.log", timeout_s=300)
    check_model_size(options, log.parameters)
    assert sorted(log.losses) == [1, 2, 3] and sorted(log.dcp) == [1, 2, 3]
    assert all(4.0 < loss < 6.0 for loss in log.losses.values())  # ≈ ln(128) at the start
    assert "validation loss at iteration 3" in log.output
    assert "megatron_dcp: no CUDA device, using the CPU backend" in log.output


def test_prefetch_on_and_off_train_alike(tmp_path):
    """--dcp-prefetch on (the default) and off: the same training and validation losses, bit for
    bit (a fixed cost model: refined coefficients follow measured times, which differ between
    runs), with evaluation between training steps and after the last one."""
    options = indexed_run_options(
        tmp_path, 80, **{"--train-iters": 4, "--eval-interval": 2, "--dcp-cost-adapt": "off"}
    )
    # The launch is not what this test is about: ranks forked from one process (the other tests
    # of this file start theirs through torchrun).
    def run(log: str):
        launcher = forked("pretrain_gpt")
        return run_pretrain(flag_list(options), 4, tmp_path / log, 300, launcher=launcher)

    on = run("on.log")
    options["--dcp-prefetch"] = "off"
    off = run("off.log")
    check_model_size(options, on.parameters)
    check_model_size(options, off.parameters)
    assert "DCP prefetch: on" in on.output and "DCP prefetch: off" in off.output
    assert sorted(on.losses) == [1, 2, 3, 4] and on.losses == off.losses
    validation = re.compile(r"validation loss at iteration (\d+).*?lm loss value: (\S+)")
    assert validation.findall(on.output) == validation.findall(off.output)
    assert len(validation.findall(on.output)) >= 2


def test_sequence_parallel_and_distributed_optimizer_on_cpu(tmp_path):
    """--sequence-parallel (tp2) and --use-distributed-optimizer are accepted on the CPU backend
    and stay on (megatron prints them; the optimizer reduce-scatters gradients) for 3 steps."""
    options = {
        "--dynamic-context-parallel": True,
        "--tensor-model-parallel-size": 2,
        "--sequence-parallel": True,
        "--use-distributed-optimizer": True,
        "--context-parallel-size": 2,
        "--max-seqlen-per-dp-cp-rank": 128,
        "--num-layers": 2,
        "--hidden-size": 64,
        "--num-attention-heads": 4,
        "--seq-length": 256,
        "--max-position-embeddings": 256,
        "--micro-batch-size": 1,
        "--global-batch-size": 8,
        "--train-iters": 3,
        "--hidden-dropout": 0.0,
        "--lr": 1e-3,
        "--tokenizer-type": "NullTokenizer",
        "--vocab-size": 128,
        "--varlen-distribution": "lognormal:mean=100,sigma=1.0,min=16,max=256",
        "--eval-iters": 0,
        "--eval-interval": 1000,
        "--log-interval": 1,
    }
    log = run_pretrain(flag_list(options), 4, tmp_path / "run.log", timeout_s=300)
    check_model_size(options, log.parameters)
    assert sorted(log.losses) == [1, 2, 3] and sorted(log.dcp) == [1, 2, 3]
    assert all(4.0 < loss < 6.0 for loss in log.losses.values())
    for setting in ("sequence_parallel", "use_distributed_optimizer"):
        assert re.search(rf"  {setting} \.+ True", log.output), setting
    assert "Using reduce-scatter for gradient reductions" in log.output


def test_bench_train_runs_on_an_indexed_dataset(tmp_path):
    """``bench-train --data-path``: the user's indexed documents replace the mock lengths (no
    "at most one data source" refusal), and every arm of a batch reads the same documents."""
    from megatron_dcp.tools.cli.bench_train import bench_train

    flags = [
        "--nproc", "2", "--arms", "static,dcp", "--batches", "2", "--warmup", "1",
        "--out", str(tmp_path / "bench"), "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", "512",
        "--max-position-embeddings", "512", "--max-seqlen-per-dp-cp-rank", "256",
        "--global-batch-size", "8", "--data-path", write_documents(tmp_path / "corpus", 64),
        "--split", "100,0,0",
    ]  # fmt: skip
    assert bench_train(flags) == 0
    flags = json.loads((tmp_path / "bench" / "bench_train.json").read_text())["flags"]
    assert "--data-path" in flags and "--varlen-distribution" not in flags
    log = (tmp_path / "bench" / "train.log").read_text()
    assert len(re.findall(r"\[DCP\] iteration", log)) == 4  # 2 batches × 2 arms
