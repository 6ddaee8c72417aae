"""Pipeline p2p on gloo (the ``pipeline`` entries of the patch table), on megatron's own
interleaved schedule without DCP: variable sequence lengths (shapes exchanged before tensors) and
as many micro-batches as stages, so that stage 0 runs every micro-batch in its warm-up. Megatron
waits for its shape sends there, and on gloo that deadlocked; the step must now finish and equal
the single-process run."""

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo entries: CPU backend only"),
]

from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.training.forward_step import forward_step  # noqa: E402
from megatron_dcp.integration.training.forward_step import global_loss  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    ReferenceResult,
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
    make_samples,
    single_process_reference,
)
from megatron_dcp.testing.oracle import assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    RanPlan,
    assert_covers,
    parallel_layout,
)

OPTIONS = TinyGPTOptions(num_layers=4)


def unpacked_batch(sample: dict) -> dict:
    """A micro-batch of one whole sample (sbhd, no CP, no packing) for ``forward_step``."""
    length = sample["tokens"].numel()
    batch = {key: sample[key].view(1, -1) for key in ("tokens", "labels", "loss_mask")}
    return {**batch, "position_ids": torch.arange(length).view(1, -1), "packed_seq_params": None}


def interleaved_step(
    rank: int, world_size: int, samples, vpp: int
) -> tuple[ReferenceResult, RanPlan]:
    """One forward-backward of megatron's interleaved schedule, one sample per micro-batch (no
    CP: every micro-batch on CP size 1); and what it ran."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_megatron(pp=world_size, vpp=vpp, seed=OPTIONS.seed)
    apply_patches()
    chunks = build_tiny_gpt(pp=world_size, vpp=vpp, options=OPTIONS)
    batches = [unpacked_batch(sample) for sample in samples]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=max(sample["tokens"].numel() for sample in samples),
        micro_batch_size=1,
        forward_only=False,
    )
    loss_sum, num_tokens = global_loss(losses)
    ran = RanPlan((1,), len(batches), parallel_layout())
    return ReferenceResult(loss_sum, num_tokens, gather_full_tensors(chunks)), ran


def test_interleaved_schedule_with_every_microbatch_in_warmup():
    """pp2·vpp2 with 2 micro-batches: stage 0's warm-up (2·(pp−1) + (vpp−1)·pp = 4) covers all
    4 virtual micro-batches."""
    samples = make_samples((37, 20), OPTIONS.vocab_size, seed=5)
    expected = single_process_reference(samples, OPTIONS)
    results = run_distributed(interleaved_step, 2, samples, 2, timeout_s=60)
    ran = [ran for _, ran in results]
    assert_covers(ran, Layout(pp=2, vpp=2), cp_sizes={1}, num_microbatches=2)
    for result, _ in results:
        assert_step_matches(result, expected)
