"""Pipeline p2p (the ``pipeline`` entries of the patch table).

On gloo, on megatron's own interleaved schedule without DCP: variable sequence lengths (shapes
exchanged before tensors) and as many micro-batches as stages, so that stage 0 runs every
micro-batch in its warm-up. Megatron waits for its shape sends there, and on gloo that
deadlocked; the step must now finish, equal the single-process run, and exchange its shapes
(megatron's own path, outside a DCP step).

In a DCP step, with 1F1B, with the interleaved schedule and with sequence parallelism: the stages
size every pipeline message from the plan, megatron's shape exchange is never called, and the
step equals the single-process run (``integration/patches/pipeline_shapes.py``)."""

from collections import Counter
from typing import Optional

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="gloo entries: CPU backend only"),
]

from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.patches.pipeline_shapes import PlannedCommunicator  # noqa: E402
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
from megatron_dcp.testing.dcp_step import dcp_training_step  # noqa: E402
from megatron_dcp.testing.oracle import assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    RanPlan,
    assert_covers,
    parallel_layout,
)

OPTIONS = TinyGPTOptions(num_layers=4)


def counting_shape_exchanges() -> Counter:
    """Count, in this (forked) worker, the calls of megatron's shape exchange (``exchanged``)
    and the shapes the plan answers in its stead (``planned``)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    apply_patches()  # before wrapping: the gloo entry replaces megatron's exchange
    calls: Counter = Counter()
    for owner, name in ((P2PCommunicator, "exchanged"), (PlannedCommunicator, "planned")):
        exchange = owner._communicate_shapes

        def counted(self, *args, _exchange=exchange, _name=name, **kwargs):
            calls[_name] += 1
            return _exchange(self, *args, **kwargs)

        owner._communicate_shapes = counted
    return calls


def unpacked_batch(sample: dict) -> dict:
    """A micro-batch of one whole sample (sbhd, no CP, no packing) for ``forward_step``."""
    length = sample["tokens"].numel()
    batch = {key: sample[key].view(1, -1) for key in ("tokens", "labels", "loss_mask")}
    return {**batch, "position_ids": torch.arange(length).view(1, -1), "packed_seq_params": None}


def interleaved_step(
    rank: int, world_size: int, samples, vpp: int
) -> tuple[ReferenceResult, RanPlan, Counter]:
    """One forward-backward of megatron's interleaved schedule, one sample per micro-batch (no
    CP: every micro-batch on CP size 1); what it ran and its shape exchanges."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_megatron(pp=world_size, vpp=vpp, seed=OPTIONS.seed)
    calls = counting_shape_exchanges()
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
    return ReferenceResult(loss_sum, num_tokens, gather_full_tensors(chunks)), ran, calls


def test_interleaved_schedule_with_every_microbatch_in_warmup():
    """pp2·vpp2 with 2 micro-batches: stage 0's warm-up (2·(pp−1) + (vpp−1)·pp = 4) covers all
    4 virtual micro-batches."""
    samples = make_samples((37, 20), OPTIONS.vocab_size, seed=5)
    expected = single_process_reference(samples, OPTIONS)
    results = run_distributed(interleaved_step, 2, samples, 2, timeout_s=60)
    ran = [ran for _, ran, _ in results]
    assert_covers(ran, Layout(pp=2, vpp=2), cp_sizes={1}, num_microbatches=2)
    for result, _, calls in results:
        assert_step_matches(result, expected)
        assert calls["exchanged"] > 0 and calls["planned"] == 0, calls


def counted_dcp_step(rank: int, world_size: int, samples, tp: int, vpp: Optional[int]) -> tuple:
    """A DCP step at tp·pp2·cp2 (with ``vpp`` chunks per stage; sequence parallelism with TP 2)
    and its shape exchanges."""
    calls = counting_shape_exchanges()
    options = TinyGPTOptions(num_layers=OPTIONS.num_layers, sequence_parallel=tp > 1)
    result = dcp_training_step(
        rank, world_size, samples, tp=tp, pp=2, cp=2, vpp=vpp, budget=100, options=options
    )
    return result, calls


LAYOUTS = {"1f1b": (1, None), "vpp2": (1, 2), "tp2sp": (2, None)}  # name: (tp, vpp)


@pytest.mark.parametrize("tp, vpp", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_dcp_step_sizes_its_pipeline_messages_from_the_plan(tp, vpp):
    """Lengths up to 200 on a budget of 100: CP groups of 1 and 2, micro-batches of different
    local lengths, each stage receiving every one of them from a neighbour; under sequence
    parallelism each message holds the stage's tokens divided by TP."""
    samples = make_samples((37, 5, 120, 64, 9, 200, 33, 71), OPTIONS.vocab_size, seed=7)
    expected = single_process_reference(samples, OPTIONS)
    results = run_distributed(counted_dcp_step, 4 * tp, samples, tp, vpp, timeout_s=240)
    assert_covers([result for result, _ in results], Layout(tp=tp, pp=2, cp=2, vpp=vpp))
    for result, calls in results:
        assert_step_matches(result, expected)
        assert calls["exchanged"] == 0, f"megatron exchanged shapes {calls['exchanged']} times"
        assert calls["planned"] > 0, calls
