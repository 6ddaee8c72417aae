"""Sequence parallelism under DCP on the CPU backend: megatron's torch norm accepts it once its
parameters are marked for the TP gradient sum, and a TP2 + SP DCP step (packed micro-batches
padded to 2·CP·TP, CP groups of different sizes in one step) equals the single-process, no-CP,
no-SP run."""

from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA"),
]

from megatron_dcp.testing.dcp_step import dcp_training_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    make_samples,
    single_process_reference,
    tiny_gpt_config,
)
from megatron_dcp.testing.oracle import assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

# The oracle's lengths with 63 for 64: with today's plans a group of one then packs an odd number
# of tokens, which only the ×TP padding of sequence parallelism makes divisible over TP.
LENGTHS = (37, 5, 120, 63, 9, 200, 33, 71)
OPTIONS = TinyGPTOptions(num_layers=2, sequence_parallel=True)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_torch_norm_accepts_sequence_parallel_and_marks_its_parameters(cpu_backend, normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for sequence_parallel in (True, False):
        config = tiny_gpt_config(2, 1, 1, None, TinyGPTOptions(sequence_parallel=sequence_parallel))
        config.normalization = normalization
        norm = WrappedTorchNorm(config=config, hidden_size=8, eps=1e-5)
        assert type(norm).__name__ == normalization
        assert config.sequence_parallel is sequence_parallel  # restored after the build
        assert {p.sequence_parallel for p in norm.parameters()} == {sequence_parallel}


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, OPTIONS.vocab_size, seed=7)


@pytest.fixture(scope="module")
def reference(samples):
    return single_process_reference(samples, OPTIONS)  # tp 1: sequence parallelism is off


@pytest.mark.parametrize(
    "world,cp,budget,largest",
    [(4, 2, 100, 2), (8, 2, 64, 4)],
    ids=["tp2cp2", "tp2dp2cp2"],
)
def test_tp2_sequence_parallel_dcp_step_equals_single_process(
    world, cp, budget, largest, samples, reference
):
    """tp2·cp2 (a DCP domain of 2: groups of 1 and 2) and tp2·dp2·cp2 (the 200-token sample needs
    all 4 positions of the domain, the others fewer). Sequences are padded to 2·c·2 so that each
    rank's packed tokens split over TP."""
    step = partial(dcp_training_step, tp=2, cp=cp, budget=budget, options=OPTIONS)
    results = run_distributed(step, world, samples, timeout_s=240)
    assert_covers(results, Layout(tp=2, dp=world // (2 * cp), cp=cp), mix_of={largest})
    for result in results:
        assert_step_matches(result, reference)
        assert max(result.cp_sizes) == largest
