"""DCP builds the static-CP plan only where it can be shorter (``against_static``): the static
plan's lower bound (``lower_bound.static_cp_lower_bound``) is a true bound of ``dp_balanced``'s
critical path, and skipping the static plan where the bound is above DCP's path returns the same
plan as building it. The critical path both sides compare is priced from memoised per-rank
costs: the same value, bit for bit, as the rank loads give."""

import math
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import cost_models, scaled

from megatron_dcp.scheduling import CostModel, Domain, build_scheduler
from megatron_dcp.scheduling.dynamic_cp import scheduler as dcp_scheduler
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.lower_bound import static_cp_lower_bound
from megatron_dcp.scheduling.metrics import critical_path, rank_loads

# Compute-bound to overhead-bound worlds, with score spill (a cost that falls as c grows).
COSTS = cost_models(spill=True)


def kwargs(dp, cp, budget, vpp, cost):
    return dict(
        dp_size=dp,
        cp_size=cp,
        max_seqlen_per_dp_cp_rank=budget,
        microbatch_group_size_per_vp_stage=vpp,
        cost_model=cost,
    )


@settings(max_examples=scaled(200), deadline=None)
@given(
    dp=st.integers(1, 6),
    cp=st.sampled_from([1, 2, 4, 8]),
    budget=st.sampled_from([16, 100, 1024]),
    vpp=st.sampled_from([None, 1, 2, 3]),
    cost=COSTS,
    data=st.data(),
)
def test_the_static_bound_is_below_the_static_plans_critical_path(dp, cp, budget, vpp, cost, data):
    lengths = data.draw(st.lists(st.integers(1, cp * budget), min_size=1, max_size=60))
    try:
        static = build_scheduler("dp_balanced", **kwargs(dp, cp, budget, vpp, cost))
        plan = static.schedule(lengths)
    except SchedulingError:
        return  # static CP cannot run this batch
    bound = static_cp_lower_bound(lengths, Domain(dp, cp, budget), cost, vpp)
    assert bound <= critical_path(plan, cost) * (1 + 1e-12)


def never_skipped(*args, **kwargs):
    """A static bound that never lets DCP skip the static plan."""
    return -math.inf


@settings(max_examples=scaled(150), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=4, max_size=48),
    dp=st.sampled_from([1, 2]),
    cp=st.sampled_from([2, 4, 8]),
    vpp=st.sampled_from([None, 2]),
    cost=COSTS,
)
def test_skipping_the_static_plan_returns_the_same_plan(lengths, dp, cp, vpp, cost):
    planner = build_scheduler("default_dynamic_cp", **kwargs(dp, cp, 2048, vpp, cost))
    shortcut = planner.schedule(lengths)
    with mock.patch.object(dcp_scheduler, "static_cp_lower_bound", never_skipped):
        built = planner.schedule(lengths)
    assert shortcut.microbatches == built.microbatches


def test_the_static_plan_is_skipped_where_it_cannot_win():
    """Overhead-bound CP (an expensive ring on 8 ranks): static CP puts every short sample on 8
    ranks, its bound is above DCP's path, and the static plan is never built."""
    cost = CostModel(linear=1.0, quadratic=1e-4, comm=0.5, ring_step=200.0)
    lengths = [100 + 37 * i % 900 for i in range(64)]
    planner = build_scheduler("default_dynamic_cp", **kwargs(2, 8, 1024, None, cost))
    with mock.patch.object(type(planner), "static_plan", side_effect=AssertionError("built")):
        plan = planner.schedule(lengths)
    assert static_cp_lower_bound(lengths, planner.domain, cost) > critical_path(plan, cost)


@settings(max_examples=scaled(100), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 2048), min_size=1, max_size=48),
    dp=st.sampled_from([1, 3]),
    cp=st.sampled_from([1, 2, 4]),
    cost=COSTS,
)
def test_the_critical_path_is_the_rank_loads_bit_for_bit(lengths, dp, cp, cost):
    plan = build_scheduler("default_dynamic_cp", **kwargs(dp, cp, 2048, None, cost)).schedule(
        lengths
    )
    loads = sum(max(rank_loads(plan, mb, cost)) for mb in plan.microbatches)
    assert critical_path(plan, cost) == loads + cost.microbatch * plan.num_microbatches
