"""megatron's distributed optimizer under DCP on the CPU backend: built on CPU fp32 parameters
(which report their CUDA type name while it is constructed), its Adam state sharded over DP×CP,
and three DCP training steps leave the weights of the single-process run (also with TP2 and
sequence parallelism, whose norm gradients megatron's finalize_model_grads sums over TP)."""

import dataclasses
from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA"),
]

from megatron_dcp.integration.cpu.parallel import CudaTypeNames  # noqa: E402
from megatron_dcp.testing.dcp_step import (  # noqa: E402
    dcp_training_run,
    reference_training_run,
    with_ddp_and_adam,
)
from megatron_dcp.testing.gpt import TinyGPTOptions, build_tiny_gpt, init_megatron  # noqa: E402
from megatron_dcp.testing.oracle import adam_batches, assert_weights_match  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

OPTIONS = TinyGPTOptions(num_layers=2)


def test_cpu_tensors_report_cuda_type_names_only_inside_the_mode():
    param = torch.nn.Parameter(torch.zeros(3))
    with CudaTypeNames():
        assert param.type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert param.type(torch.float64).dtype == torch.float64  # conversions unchanged
    assert param.type() == "torch.FloatTensor"


def _shards(rank, world_size):
    init_megatron()
    chunks = build_tiny_gpt(options=OPTIONS)
    _, optimizer = with_ddp_and_adam(chunks, distributed_optimizer=True)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    owned = sum(shard.numel() for o in inner for group in o.shard_fp32_groups for shard in group)
    total = sum(p.numel() for p in chunks[0].parameters())
    return [type(o).__name__ for o in inner], owned, total


def test_distributed_optimizer_shards_cpu_parameters_over_dp():
    results = run_distributed(_shards, 2, timeout_s=120)
    assert all(names == ["DistributedOptimizer"] for names, _, _ in results)
    owned = [count for _, count, _ in results]
    assert sum(owned) == results[0][2] and min(owned) > 0  # every element on exactly one rank


@pytest.fixture(scope="module")
def batches():
    return adam_batches(OPTIONS.vocab_size)


@pytest.fixture(scope="module")
def expected(batches):
    (weights,) = run_distributed(reference_training_run, 1, batches, OPTIONS, timeout_s=240)
    return weights


@pytest.mark.parametrize(
    "tp,sequence_parallel,budget", [(1, False, 64), (2, True, 100)], ids=["dp2cp2", "tp2sp_cp2"]
)
def test_weights_after_three_adam_steps_equal_single_process(
    tp, sequence_parallel, budget, batches, expected
):
    """dp2·cp2 (Adam state sharded over the 4 DP×CP ranks) and tp2·cp2 with sequence
    parallelism (sharded over 2, a DP×CP domain that holds 200 tokens at budget 100). Same
    tolerance as the DDP + Adam oracle: Adam turns float noise in near-zero gradients into
    updates of up to the learning rate, 1e-2."""
    options = dataclasses.replace(OPTIONS, sequence_parallel=sequence_parallel)
    run = partial(
        dcp_training_run, tp=tp, cp=2, budget=budget, options=options, distributed_optimizer=True
    )
    results = run_distributed(run, 4, batches, timeout_s=240)
    assert_covers(results, Layout(tp=tp, dp=2 // tp, cp=2))  # plans mixing CP sizes
    for result in results:
        assert_weights_match(result.weights, expected)
