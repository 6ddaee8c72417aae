"""MTP under DCP equals the single-process run: the main loss, and every gradient, MTP heads and
the layers they feed included.

megatron weighs each MTP depth of a micro-batch by that micro-batch's own token ratio, so its
MTP gradient depends on the packing. With DCP the ratio is the global batch's
(``integration.patches.mtp_loss``): the gradient of one plan equals that of one micro-batch holding
the whole batch without CP, which megatron's own rule computes in a single process. That run is
the reference here (one packed micro-batch, no CP, megatron's ``process_mtp_loss``), for the DCP
step and for the RL adapter's loop."""

from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.patches import mtp_loss as mtp_patch  # noqa: E402
from megatron_dcp.testing.dcp_step import dcp_training_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    ReferenceResult,
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
    make_samples,
    packed_loss_and_backward,
    packed_token_losses,
    reference_passes,
)
from megatron_dcp.testing.oracle import assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    RanPlan,
    assert_covers,
    parallel_layout,
)

# With budget 64 on N = 4: 200 needs the whole domain, 120 and 71 two ranks, the rest one.
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
DP2CP2 = Layout(dp=2, cp=2)


def options(depth: int) -> TinyGPTOptions:
    return TinyGPTOptions(num_layers=2, mtp_layers=depth)


def one_microbatch_reference(rank: int, world_size: int, samples, depth: int) -> ReferenceResult:
    """The whole batch as one packed micro-batch, one process, no CP."""
    init_megatron(seed=options(depth).seed)
    return reference_passes(samples, options(depth), run=packed_loss_and_backward)


def dcp_step(rank: int, world_size: int, samples, depth: int, cp: int, megatron_rule: bool):
    """A DCP step; ``megatron_rule``: without the MTP patch (megatron's per-micro-batch ratio)."""
    if megatron_rule:  # the patch looks for another attribute: megatron's function runs
        mtp_patch.MTP_RATIOS_ATTRIBUTE = "not_set_by_the_wrapper"
    return dcp_training_step(rank, world_size, samples, cp=cp, budget=64, options=options(depth))


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def reference(samples):
    cache = {}

    def run(depth: int) -> ReferenceResult:
        if depth not in cache:
            (cache[depth],) = run_distributed(one_microbatch_reference, 1, samples, depth)
        return cache[depth]

    return run


@pytest.mark.parametrize(
    "depth,cp", [(1, 2), (2, 2), (2, 4)], ids=["d1-dp2cp2", "d2-dp2cp2", "d2-cp4"]
)
def test_mtp_gradients_equal_single_process(samples, reference, depth, cp):
    """Loss, token count and every gradient within the oracle's tolerances; the plan mixes CP
    sizes (a whole-domain group beside smaller ones)."""
    step = partial(dcp_step, depth=depth, cp=cp, megatron_rule=False)
    results = run_distributed(step, 4, samples, timeout_s=180)
    assert_covers(results, Layout(dp=4 // cp, cp=cp), mix_of={4})
    for result in results:
        assert_step_matches(result, reference(depth))
        assert any(name.startswith("mtp.") for name in result.grads)


def test_megatron_rule_depends_on_the_packing(samples, reference):
    """Without the patch, megatron's per-micro-batch ratio gives other MTP gradients: the test
    above would catch a DCP step that lost the global ratio."""
    step = partial(dcp_step, depth=1, cp=2, megatron_rule=True)
    result = run_distributed(step, 4, samples, timeout_s=180)[0]
    assert_covers(result, DP2CP2)  # micro-batches of different token ratios
    expected = reference(1)
    assert result.loss_sum == pytest.approx(expected.loss_sum, rel=1e-5)
    with pytest.raises(AssertionError):
        assert_step_matches(result, expected)


def adapter_step(rank: int, world_size: int, samples, depth: int):
    """The RL adapter's loop (every rank holds the whole batch) on cp2·dp2: the mini-batch
    token count and the full gradients of the token-mean loss, MTP weighted like the main loss."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from megatron_dcp.adapters import split_batch, token_mean_loss
    from megatron_dcp.adapters.loss import split_loss_scale
    from megatron_dcp.integration.config import DCPConfig
    from megatron_dcp.integration.process_groups import create_dcp_groups

    init_megatron(cp=2, seed=options(depth).seed)
    apply_patches()
    (model,) = build_tiny_gpt(cp=2, options=options(depth))
    groups = create_dcp_groups()
    split = split_batch(samples, groups, DCPConfig.for_model(model.config, 64), mtp_depth=depth)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(split_loss_scale(split)))
    for mb in split.microbatches:
        losses = packed_token_losses(model, mb.packed, mb.packed_seq_params)
        token_mean_loss(losses, mb, split).backward()
    grads = gather_full_tensors([model])
    groups.destroy()
    sizes = tuple(sorted({mb.local_cp_size for mb in split.microbatches}))
    return split.num_tokens, RanPlan(sizes, len(split.microbatches), parallel_layout()), grads


@pytest.mark.parametrize("depth", [1, 2])
def test_rl_adapter_mtp_gradients_equal_single_process(samples, reference, depth):
    """The adapter's token-mean gradients, times the token count, are the reference's sums."""
    expected = reference(depth)
    for num_tokens, ran, grads in run_distributed(
        partial(adapter_step, depth=depth), 4, samples, timeout_s=180
    ):
        assert num_tokens == expected.num_tokens
        assert_covers(ran, DP2CP2)  # every rank's own micro-batches mix CP sizes
        for name, grad in expected.grads.items():
            torch.testing.assert_close(
                grads[name] * num_tokens, grad, rtol=1e-4, atol=1e-5, msg=name
            )


def record_mtp_terms(depth: int) -> list:
    """Per depth, the sum of the MTP loss term each forward hands ``MTPLossAutoScaler`` (scale ×
    token ratio × masked per-token losses: its contribution before the division by N). A forked
    worker: the parent's class is untouched."""
    from megatron.core.transformer import multi_token_prediction as mtp

    sums, calls, original = [0.0] * depth, [0], mtp.MTPLossAutoScaler.apply

    def apply(hidden, loss):
        sums[calls[0] % depth] += float(loss.detach().double().sum())
        calls[0] += 1
        return original(hidden, loss)

    mtp.MTPLossAutoScaler.apply = apply
    return sums


def dcp_mtp_terms(rank: int, world_size: int, samples, depth: int) -> tuple:
    sums = record_mtp_terms(depth)
    result = dcp_training_step(rank, world_size, samples, cp=2, budget=64, options=options(depth))
    return sums, result


def reference_mtp_terms(rank: int, world_size: int, samples, depth: int) -> list:
    """megatron's single-process MTP terms: one float32 pass of the whole batch, packed."""
    sums = record_mtp_terms(depth)
    init_megatron(seed=options(depth).seed)
    (model,) = build_tiny_gpt(options=options(depth))
    packed_loss_and_backward(model, samples)
    return sums


def test_mtp_loss_value_of_each_depth_equals_single_process(samples):
    """The MTP loss itself, depth by depth, summed over ranks and micro-batches, equals megatron's
    single-process value (a swap of depths, or a ratio of the wrong depth, moves it)."""
    depth = 2
    results = run_distributed(dcp_mtp_terms, 4, samples, depth, timeout_s=180)
    (expected,) = run_distributed(reference_mtp_terms, 1, samples, depth, timeout_s=180)
    assert_covers([result for _, result in results], DP2CP2)
    got = [sum(sums[d] for sums, _ in results) for d in range(depth)]
    assert got == pytest.approx(expected, rel=1e-5)
    assert abs(expected[0] - expected[1]) > 1e-3 * abs(expected[0])  # the depths differ
