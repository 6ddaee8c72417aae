"""megatron's communication overlaps under DCP on the CPU backend (gloo), against the
single-process run: DDP's overlapped gradient reduction (plain DDP and the distributed optimizer),
the distributed optimizer's overlapped parameter all-gather (also aligned across pipeline stages)
and the interleaved schedule's p2p overlap. Each test also checks that the overlap really ran
(buckets reduced from the backward pass, all-gathers waited on in forward pre-hooks, unbatched
p2p), so a setting that silently falls back to the synchronous path fails."""

from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA"),
]

from megatron_dcp.testing.dcp_step import (  # noqa: E402
    dcp_training_run,
    dcp_training_step,
    reference_training_run,
)
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    make_samples,
    single_process_reference,
)
from megatron_dcp.testing.oracle import (  # noqa: E402
    adam_batches,
    assert_step_matches,
    assert_weights_match,
)
from megatron_dcp.testing.overlap import CommOverlap  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

OPTIONS = TinyGPTOptions(num_layers=4)  # pp2·vpp2 needs a multiple of 4 layers
STEP_LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71, 16, 150, 90, 2)
# About a third of a layer's parameters: a chunk has several buckets, each reduced during the
# backward pass (megatron's default bucket holds the whole tiny model: nothing to overlap).
BUCKET_SIZE = 10_000
GRAD_REDUCE = CommOverlap(grad_reduce=True, bucket_size=BUCKET_SIZE)
PARAM_GATHER = CommOverlap(grad_reduce=True, param_gather=True, bucket_size=BUCKET_SIZE)
# megatron.training's interleaved-schedule defaults (p2p overlap, aligned all-gathers and grad
# reductions) with --overlap-grad-reduce --overlap-param-gather.
VPP_ALL = CommOverlap(
    grad_reduce=True, param_gather=True, align_param_gather=True, bucket_size=BUCKET_SIZE, p2p=True
)


def counting_overlaps(run, rank, world_size, *args, **kwargs):
    """``run(rank, world_size, ...)`` with megatron's overlapped communication counted (patched in
    this forked worker only): bucket reductions started before the schedule's final
    ``finish_grad_sync`` (from the backward pass once the first step has recorded which
    gradients each bucket waits for, or by the interleaved schedule's ``grad_sync_func``; the
    synchronous path starts them all inside ``finish_grad_sync``), parameter all-gathers left in
    flight (the synchronous path waits for them at once), and unbatched pipeline p2p exchanges
    (``_p2p_ops``: overlap only)."""
    from megatron.core.distributed import param_and_grad_buffer as buffers
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    counts = {"early_reductions": 0, "async_gathers": 0, "unbatched_p2p": 0, "finishing": 0}
    group_class = buffers._ParamAndGradBucketGroup
    start_grad_sync, start_param_sync = group_class.start_grad_sync, group_class.start_param_sync
    finish_grad_sync, p2p_ops = group_class.finish_grad_sync, p2p._p2p_ops

    def counted_start_grad_sync(self, *a, **k):
        counts["early_reductions"] += not counts["finishing"]
        return start_grad_sync(self, *a, **k)

    def counted_finish_grad_sync(self, *a, **k):
        counts["finishing"] += 1
        try:
            return finish_grad_sync(self, *a, **k)
        finally:
            counts["finishing"] -= 1

    def counted_start_param_sync(self, *a, **k):
        result = start_param_sync(self, *a, **k)
        counts["async_gathers"] += self.param_gather_handle is not None
        return result

    def counted_p2p_ops(**k):
        counts["unbatched_p2p"] += 1
        return p2p_ops(**k)

    group_class.start_grad_sync = counted_start_grad_sync
    group_class.start_param_sync = counted_start_param_sync
    group_class.finish_grad_sync = counted_finish_grad_sync
    p2p._p2p_ops = counted_p2p_ops
    return run(rank, world_size, *args, **kwargs), counts


@pytest.fixture(scope="module")
def batches():
    return adam_batches(OPTIONS.vocab_size)


@pytest.fixture(scope="module")
def expected(batches):
    (weights,) = run_distributed(reference_training_run, 1, batches, OPTIONS, timeout_s=240)
    return weights


@pytest.mark.parametrize(
    "layout,distributed_optimizer,overlap",
    [
        (dict(cp=2), False, GRAD_REDUCE),
        (dict(cp=2), True, GRAD_REDUCE),
        (dict(cp=2), True, PARAM_GATHER),
        (dict(pp=2, cp=2, budget=100), True, PARAM_GATHER),
        (dict(pp=2, vpp=2, cp=2, budget=100), True, VPP_ALL),
    ],
    ids=[
        "dp2cp2-ddp-grad",
        "dp2cp2-distopt-grad",
        "dp2cp2-distopt-grad-param",
        "pp2cp2-distopt-grad-param",
        "pp2vpp2cp2-all",
    ],
)
def test_weights_after_three_adam_steps_with_overlap_equal_single_process(
    layout, distributed_optimizer, overlap, batches, expected
):
    """Three DCP steps with megatron's overlaps on: the weights of the single-process run (the
    tolerance of the DDP + Adam oracle, test_dcp_oracle.py). dp2·cp2 at budget 64 (groups of 1,
    2 and 4 ranks); pp2·cp2 (1F1B, a domain of 2 at budget 100); pp2·vpp2·cp2 with every overlap
    on as megatron.training sets it up for the interleaved schedule."""
    layout = {"budget": 64, **layout}
    run = partial(
        dcp_training_run,
        options=OPTIONS,
        distributed_optimizer=distributed_optimizer,
        overlap=overlap,
        **layout,
    )
    results = run_distributed(partial(counting_overlaps, run), 4, batches, timeout_s=240)
    pp, cp = layout.get("pp", 1), layout["cp"]
    claimed = Layout(pp=pp, vpp=layout.get("vpp"), dp=4 // (pp * cp), cp=cp)
    assert_covers([result for result, _ in results], claimed)  # plans mixing CP sizes
    for result, counts in results:
        assert_weights_match(result.weights, expected)
        # At least steps 2 and 3 start their reductions early (one bucket on later pipeline
        # stages, where megatron turns bucketing off; several on the first).
        assert counts["early_reductions"] >= 2, counts
        assert (counts["async_gathers"] > 0) == overlap.param_gather, counts
        assert (counts["unbatched_p2p"] > 0) == overlap.p2p, counts


@pytest.fixture(scope="module")
def step_samples():
    return make_samples(STEP_LENGTHS, OPTIONS.vocab_size, seed=7)


@pytest.fixture(scope="module")
def step_reference(step_samples):
    return single_process_reference(step_samples, OPTIONS)


@pytest.mark.parametrize(
    "overlap",
    [CommOverlap(p2p=True), CommOverlap(p2p=True, p2p_warmup_flush=True)],
    ids=["overlap", "overlap-warmup-flush"],
)
def test_overlapped_p2p_step_equals_single_process(overlap, step_samples, step_reference):
    """pp2·vpp2·cp2 (DCP groups of 1 and 2 ranks, 6 micro-batches: warm-up, steady 1F1B and
    cool-down) with ``overlap_p2p_comm``, megatron.training's default under VPP, also with
    ``--overlap-p2p-communication-warmup-flush``: loss, token count and every gradient equal the
    single-process step. The exchanges are unbatched p2p (``_p2p_ops``, which at pipeline size 2
    uses the world group for one direction), waited on just before use, instead of the tagged
    batched ops of the ``pipeline_p2p_tags`` patch."""
    # Planned under the latency-heavy cost model: there DCP's own plan (9 sequences on CP 1,
    # 3 on CP 2, 6 micro-batches) beats the static-CP plan (4 micro-batches), which the tiny
    # model's CPU cost model would choose (its fixed cost per micro-batch dominates).
    step = partial(
        dcp_training_step,
        pp=2,
        vpp=2,
        cp=2,
        budget=100,
        options=OPTIONS,
        overlap=overlap,
        cost_model=build_cost_model("latency"),
    )
    results = run_distributed(partial(counting_overlaps, step), 4, step_samples, timeout_s=240)
    claimed = Layout(pp=2, vpp=2, dp=1, cp=2)
    assert_covers([result for result, _ in results], claimed, mix_of={1, 2}, min_microbatches=5)
    for result, counts in results:
        assert_step_matches(result, step_reference)
        assert counts["unbatched_p2p"] > 0, counts
