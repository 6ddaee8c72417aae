"""The group-count ring bound (``scheduling.group_count_bound``): the small simplex it solves the
dual with, the repair that keeps its value a bound whatever the float error, a case where it is
exact and the other two ring bounds are not, and the inequality itself against every
scheduler's plans under random coefficients and node tiers."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import cases, cost_models, parametrize_names, plan_or_none, scaled

from megatron_dcp.scheduling import CostModel, Domain, build_scheduler
from megatron_dcp.scheduling.group_count_bound import (
    constraint_rows,
    dual_value,
    group_count_ring,
    maximize,
)
from megatron_dcp.scheduling.lower_bound import coverage_ring, fewest_microbatches, ring_shares

RING = CostModel(1.0, 0.0, ring_step=10.0)


def test_the_simplex_solves_a_textbook_program():
    """max 3x + 5y s.t. x ≤ 4, 2y ≤ 12, 3x + 2y ≤ 18: x = 2, y = 6, value 36; unbounded: None."""
    solution = maximize([3.0, 5.0], [[1.0, 0.0], [0.0, 2.0], [3.0, 2.0]], [4.0, 12.0, 18.0])
    assert solution == pytest.approx([2.0, 6.0])
    assert maximize([1.0], [[-1.0]], [1.0]) is None


def test_a_repaired_dual_stays_below_every_plan():
    """Multipliers pushed off the optimum (too large, or negative) are made feasible before
    they are valued: the value never exceeds the ring cost of a real plan."""
    domain, lengths = Domain(4, 1, 10), [2, 39, 12]
    rows = constraint_rows(Counter(lengths), domain, 2, domain.cp_degrees(lengths))
    weights = [size * RING.ring_cost(size) for size in domain.group_sizes]
    columns = [[row[0][c] for row in rows] for c in range(len(weights))]
    best = maximize([row[1] for row in rows], columns, weights)
    for scale in (1.5, 3.0):
        value = dual_value(rows, columns, weights, [v * scale for v in best])
        assert value <= 160.0 * (1 + 1e-12)
    assert dual_value(rows, columns, weights, [-1.0] * len(best)) <= 0.0


def test_few_samples_and_a_long_one_are_priced_exactly():
    """Four ranks, budget 10, VPP 2, samples of 2, 39 and 12 tokens: the 39 needs all four ranks
    in one micro-batch, the other holds two samples, so two groups of two (the 12 needs two).
    The plan pays 160 of ring; shares say 138 and coverage 133, the group counts 160."""
    domain, lengths = Domain(4, 1, 10), [2, 39, 12]
    count = fewest_microbatches(lengths, domain, 2)
    shares = ring_shares(domain, RING)
    shared = sum(
        shares[domain.cp_degree(L)][0] + shares[domain.cp_degree(L)][1] * L for L in lengths
    )
    assert shared == pytest.approx(138.0)
    assert coverage_ring(len(lengths), count, domain.size, RING) == pytest.approx(400 / 3)
    assert group_count_ring(Counter(lengths), domain, RING, count) == pytest.approx(160.0)
    plan = build_scheduler(
        "default_dynamic_cp",
        dp_size=4,
        cp_size=1,
        max_seqlen_per_dp_cp_rank=10,
        microbatch_group_size_per_vp_stage=2,
        cost_model=RING,
    ).schedule(lengths)
    paid = sum(g.size * RING.ring_cost(g.size) for mb in plan.microbatches for g in mb.groups)
    assert paid == pytest.approx(160.0)


COSTS = cost_models(nodes=True)


@parametrize_names
@settings(max_examples=scaled(150), deadline=None)
@given(data=st.data(), cost=COSTS)
def test_no_plan_pays_less_ring_than_the_bound(name, data, cost):
    """Every scheduler's plan, priced under random ring costs and node tiers, pays at least the
    group-count bound of its lengths and fewest micro-batches."""
    plan = plan_or_none(name, data.draw(cases(name)))
    if plan is None or not plan.seqlens:
        return
    count = fewest_microbatches(plan.seqlens, plan.domain, plan.microbatch_group_size_per_vp_stage)
    paid = sum(g.size * cost.ring_cost(g.size) for mb in plan.microbatches for g in mb.groups)
    bound = group_count_ring(Counter(plan.seqlens), plan.domain, cost, count)
    assert bound <= paid * (1 + 1e-9) + 1e-9
