"""MoE layers under DCP (CPU, gloo): megatron's local experts, the alltoall dispatcher, expert
parallelism 2 at world 4 (dp2·cp2), top-2 routing, and the three router losses (aux_loss,
seq_aux_loss, z-loss).

The router all-reduces its statistics over the tensor×context-parallel group; under DCP that must
be the micro-batch's CP group (``moe_router_group`` patch). The aux losses are batch statistics:
they depend on which tokens a pack holds. With four samples of 64 tokens and a budget of 64 / c,
a group of c ranks holds at most one sample; the tests check that every group of the plan has c
ranks (c = 1, 2, 4), so each pack is one sequence, whose aux losses the single-process run
computes too, and a step must give the same aux losses and gradients for every c. 64 is a
multiple of 2·4, so no padding token enters the router.
"""

import dataclasses
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA"),
]

from megatron_dcp.integration.model_checks import check_moe  # noqa: E402
from megatron_dcp.testing.dcp_step import dcp_training_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    init_megatron,
    make_samples,
    reference_passes,
)
from megatron_dcp.testing.oracle import assert_runs_agree, assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

MOE = TinyGPTOptions(
    num_layers=2,
    add_bias_linear=False,  # megatron's SequentialMLP experts fail with linear biases
    num_moe_experts=4,
    moe_router_topk=2,
    expert_parallel=2,
)
# Large coefficients, so that a wrong aux-loss gradient shows beyond the gradient tolerances.
AUX_ON = dataclasses.replace(
    MOE,
    moe_router_load_balancing_type=("aux_loss", "seq_aux_loss"),
    moe_aux_loss_coeff=(0.5, 0.5),
    moe_z_loss_coeff=0.1,
)
TRACKED = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
EQUAL_LENGTHS = (64, 64, 64, 64)
# (scheduler, budget) -> the one CP size every group of the plan has.
ONE_SAMPLE_PER_GROUP = {
    ("default_dynamic_cp", 64): 1,
    ("dp_balanced", 32): 2,  # static CP: the groups are the static CP blocks of 2
    ("default_dynamic_cp", 16): 4,
}
DP2CP2 = Layout(dp=2, cp=2)  # the layout of run_moe_step (EP 2 inside DP×CP)


def tracked_losses() -> dict:
    """This rank's aux-loss tracker (megatron's MoE metrics), each summed over layers: the
    rank's shares of its packs' losses (z-loss: the mean over its tokens, per micro-batch)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    metrics = get_moe_metrics_tracker().metrics
    return {name: float(entry.values.sum()) for name, entry in metrics.items()}


def reported_losses(num_microbatches: int) -> dict:
    """What megatron.training logs: the tracker's report (collectives over the groups the router
    recorded, then DP), with its loss scale 1 / num_microbatches, averaged over layers."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    logged: dict = {}
    get_moe_metrics_tracker().report(
        loss_scale=1 / num_microbatches,
        iteration=0,
        num_layers=MOE.num_layers,
        total_loss_dict=logged,
    )
    return {name: float(value) for name, value in logged.items()}


def moe_step(rank, world_size, samples, **step):
    """A DCP step; this rank's tracker before the report, and the reported values."""
    from megatron.core import parallel_state

    result = dcp_training_step(rank, world_size, samples, **step)
    tracked = tracked_losses()
    num_microbatches = len(samples) // parallel_state.get_data_parallel_world_size()
    return result, tracked, reported_losses(num_microbatches)


def moe_reference(rank, world_size, samples, options):
    """The single-process run (no parallelism, every sample on its own) and its tracker."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    init_megatron(seed=options.seed)
    single = dataclasses.replace(options, expert_parallel=1)
    result = reference_passes(samples, single, before_pass=get_moe_metrics_tracker().clear)
    return result, tracked_losses()


def run_moe_step(samples, options, scheduler, budget):
    step = partial(moe_step, cp=2, scheduler=scheduler, budget=budget, options=options)
    results = run_distributed(step, 4, samples, timeout_s=240)
    return results[0][0], summed(tracked for _, tracked, _ in results), results[0][2]


def summed(per_rank) -> dict:
    """The ranks' tracker values added up, by metric."""
    total: dict = {}
    for tracked in per_rank:
        for name, value in tracked.items():
            total[name] = total.get(name, 0.0) + value
    return total


@pytest.fixture(scope="module")
def equal_samples():
    return make_samples(EQUAL_LENGTHS, MOE.vocab_size, seed=11)


@pytest.fixture(scope="module")
def aux_reference(equal_samples):
    (reference,) = run_distributed(moe_reference, 1, equal_samples, AUX_ON, timeout_s=240)
    return reference


@pytest.fixture(scope="module")
def aux_runs(equal_samples):
    """(scheduler, budget) -> (step result, aux losses summed over the ranks, the values
    megatron.training would log)."""
    return {key: run_moe_step(equal_samples, AUX_ON, *key) for key in ONE_SAMPLE_PER_GROUP}


def assert_same_aux_losses(tracked: dict, expected: dict, cp_size: int) -> None:
    """aux_loss and seq_aux_loss: the ranks' shares add up to each pack's loss. z-loss: each rank
    records the mean over its own tokens, so the ranks of a group of ``cp_size`` (equal shares,
    no padding) add up to ``cp_size`` times the sequence's mean."""
    assert set(tracked) == set(TRACKED) == set(expected)
    for name in TRACKED:
        scale = cp_size if name == "z_loss" else 1
        assert tracked[name] == pytest.approx(expected[name] * scale, rel=1e-5), name


@pytest.mark.parametrize("key", list(ONE_SAMPLE_PER_GROUP), ids=lambda k: f"{k[0]}-{k[1]}")
def test_aux_losses_and_gradients_do_not_depend_on_the_cp_size(key, aux_runs, aux_reference):
    """CP groups of 1 (smaller than the static CP group of 2) and 4 (larger) under DCP, and the
    static groups of 2: the same aux losses of each kind and the same gradients (aux and z-loss
    gradients included) as the single-process run."""
    (result, tracked, _), (reference, expected) = aux_runs[key], aux_reference
    cp_size = ONE_SAMPLE_PER_GROUP[key]
    assert_covers(result, DP2CP2, cp_sizes={cp_size})
    assert_same_aux_losses(tracked, expected, cp_size)
    assert_step_matches(result, reference)


@pytest.mark.parametrize("key", list(ONE_SAMPLE_PER_GROUP), ids=lambda k: f"{k[0]}-{k[1]}")
def test_logged_aux_losses_under_dcp(key, aux_runs):
    """megatron's report runs its collectives without a mismatch (the router records the static
    group) and logs, per layer, Σ over packs of their aux loss / (dp · K) and the rank mean of
    Σ over micro-batches of each rank's mean z-loss / K, K the configured micro-batch count
    (docs/runtime.md, "MoE layers")."""
    _, tracked, logged = aux_runs[key]
    dp, ranks, k, layers = 2, 4, len(EQUAL_LENGTHS) // 2, MOE.num_layers
    for name in ("load_balancing_loss", "seq_load_balancing_loss"):
        assert logged[name] == pytest.approx(tracked[name] / (dp * k * layers), rel=1e-5)
    assert logged["z_loss"] == pytest.approx(tracked["z_loss"] / (ranks * k * layers), rel=1e-5)


def test_dcp_equals_static_cp_under_dp_balanced(aux_runs, aux_reference):
    """DCP's groups of 1 and 4 against static CP (``dp_balanced``: the static groups of 2), aux
    losses on: the same loss, aux losses and gradients (within twice the oracle's tolerance)."""
    static, static_tracked, _ = aux_runs[("dp_balanced", 32)]
    assert_covers(static, DP2CP2, cp_sizes={2})
    for key in [("default_dynamic_cp", 64), ("default_dynamic_cp", 16)]:
        result, tracked, _ = aux_runs[key]
        assert_covers(result, DP2CP2, cp_sizes={ONE_SAMPLE_PER_GROUP[key]})  # 1, then 4
        assert_runs_agree(result, static, aux_reference[0])
        for name in ("load_balancing_loss", "seq_load_balancing_loss"):
            assert tracked[name] == pytest.approx(static_tracked[name], rel=1e-5)


def test_main_loss_equals_single_process_with_mixed_cp_sizes():
    """Aux losses off, mixed lengths (groups of 1, 2 and 4 ranks in one step, packs of one or
    more samples), EP 2: loss, token count and gradients equal the single-process run."""
    samples = make_samples((37, 5, 120, 64, 9, 200, 33, 12), MOE.vocab_size, seed=7)
    reference, _ = run_distributed(moe_reference, 1, samples, MOE, timeout_s=240)[0]
    result, _, _ = run_moe_step(samples, MOE, "default_dynamic_cp", 64)
    assert_covers(result, DP2CP2, mix_of={1, 2, 4})
    assert_step_matches(result, reference)


def test_full_recompute_re_runs_the_router_on_the_micro_batch_group(equal_samples, aux_reference):
    """Full recomputation re-runs each layer (router included) in the backward pass, through the
    layer's forward and so through the switch: groups of 4 still give the reference's aux losses
    and gradients."""
    full = dataclasses.replace(
        AUX_ON, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    result, tracked, _ = run_moe_step(equal_samples, full, "default_dynamic_cp", 16)
    reference, expected = aux_reference
    assert_covers(result, DP2CP2, cp_sizes={4})
    assert_same_aux_losses(tracked, expected, 4)
    assert_step_matches(result, reference)


def test_start_up_refuses_moe_recompute_and_accepts_tp():
    """ "moe" recomputation re-runs the router outside the switch: refused before the first step
    (dense models are not affected). TP > 1 is accepted: the wrapper creates the TP×CP groups."""
    base = {"tensor_model_parallel_size": 1, "recompute_granularity": None}
    config = SimpleNamespace(**base, recompute_modules=None)
    moe_recompute = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    with pytest.raises(ValueError, match="modules moe"):
        check_moe(SimpleNamespace(**{**vars(config), **moe_recompute}, num_moe_experts=4))
    check_moe(SimpleNamespace(**{**vars(config), **moe_recompute}, num_moe_experts=None))
    check_moe(
        SimpleNamespace(**{**vars(config), "tensor_model_parallel_size": 2}, num_moe_experts=4)
    )


def tp_cp_groups_worker(rank, world_size):
    """This rank's TP×CP groups at tp2·cp2 (DP 1): ranks per CP size, communicator counts."""
    from megatron_dcp.integration.process_groups import (
        create_dcp_groups,
        create_tp_cp_groups,
        tp_cp_group_for,
    )
    from megatron_dcp.scheduling import CPGroup

    init_megatron(tp=2, cp=2)
    groups = create_dcp_groups()
    tp_cp = create_tp_cp_groups(groups)
    solo = CPGroup(ranks=(groups.position,), sample_ids=(0,))
    assert tp_cp_group_for(tp_cp, groups, solo) is tp_cp.group(2)
    return {c: tp_cp.ranks(2 * c) for c in groups.sizes}, tp_cp.communicator_count()


def test_tp_cp_groups_are_tp_times_each_cp_block():
    """Global rank = tp_rank + 2 · cp_rank: the TP×CP group of a CP group of 1 is the TP group,
    of 2 the static TP×CP group (both megatron's, reused: no new communicator)."""
    results = run_distributed(tp_cp_groups_worker, 4, timeout_s=120)
    for rank, (ranks, count) in enumerate(results):
        assert ranks == {1: (rank // 2 * 2, rank // 2 * 2 + 1), 2: (0, 1, 2, 3)}
        assert (count.created, count.reused) == (0, 2)


# TP 2 x CP 2 (world 4, DP 1) with sequence parallelism (megatron's MoE wants it with TP), EP 2
# and expert TP 1 (with expert TP 2 the dispatcher all-gathers uneven token counts over TP, which
# gloo cannot). A DP×CP domain of 2 positions: with a budget of 32 a 64-token sample needs a
# group of 2 and a 32-token one runs alone, so one step mixes groups of 1 (the router reduces
# over the TP group) and 2 (over a TP×CP group of 4), one sample per pack.
# Expert tensor parallelism 1: each TP rank holds whole experts.
TP_MOE = dataclasses.replace(AUX_ON, sequence_parallel=True, expert_tensor_parallel=1)
TP_LENGTHS = (64, 32, 32, 64)


def test_tp2_aux_losses_and_gradients_with_mixed_cp_sizes_equal_single_process():
    """MoE at tp2·cp2 with aux, seq-aux and z losses: the router of each micro-batch reduces over
    TP × its CP group (the TP group for a group of 1), so loss, token count and gradients (aux
    and z-loss gradients included) equal the single-process run."""
    samples = make_samples(TP_LENGTHS, MOE.vocab_size, seed=5)
    reference, _ = run_distributed(moe_reference, 1, samples, TP_MOE, timeout_s=240)[0]
    step = partial(moe_step, tp=2, cp=2, budget=32, options=TP_MOE)
    result = run_distributed(step, 4, samples, timeout_s=240)[0][0]
    assert_covers(result, Layout(tp=2, cp=2), mix_of={1, 2})
    assert_step_matches(result, reference)
