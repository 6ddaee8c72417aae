"""The lower bound (``scheduling.lower_bound``): each inequality of its proof on its own, and
cases where it is exact and the fluid bound is not. That it stays below every scheduler's
critical path under random coefficients is tested with the plan invariants
(``test_properties_invariants``) and over nodes (``test_topology``)."""

import itertools
import math
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scheduling_strategies import scaled

from megatron_dcp.scheduling import CostModel, Domain, build_scheduler
from megatron_dcp.scheduling.lower_bound import (
    batch_lower_bound,
    coverage_ring,
    fewest_microbatches,
    ring_shares,
    shorter_group_cap,
    unpaired_half_idle,
)
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
from megatron_dcp.scheduling.topology import NodeLayout

RING = CostModel(1.0, 0.0, ring_step=50.0)


def scheduler(ranks, budget, cost, vpp=None):
    return build_scheduler(
        "default_dynamic_cp",
        dp_size=ranks,
        cp_size=1,
        max_seqlen_per_dp_cp_rank=budget,
        microbatch_group_size_per_vp_stage=vpp,
        cost_model=cost,
    )


def share(shares, domain, seqlen):
    base, rate = shares[domain.cp_degree(seqlen)]
    return base + rate * seqlen


def fluid_ring(seqlens, domain, cost):
    """The fluid bound's ring term: every group packed to the budget."""
    return sum(L * cost.ring_cost(domain.cp_degree(L)) / domain.budget for L in seqlens)


@st.composite
def groups(draw):
    """(domain, cost, group size, lengths of one group of that size that keeps the budget)."""
    dp = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    cp = draw(st.sampled_from([1, 2, 4]))
    budget = draw(st.integers(1, 64))
    min_cp = draw(st.sampled_from([1, 1, 2]))
    assume(min_cp <= dp * cp)
    domain = Domain(dp, cp, budget, min_cp)
    per_node = draw(st.sampled_from([None, 1, 2, 4]))
    nodes = None
    if per_node:
        nodes = NodeLayout(per_node, draw(st.floats(1, 10)), draw(st.floats(1, 4)))
    cost = CostModel(1.0, draw(st.floats(0, 1)), ring_step=draw(st.floats(0, 100)), nodes=nodes)
    size = draw(st.sampled_from(domain.group_sizes))
    room, lengths = size * budget, []
    while room > 0 and len(lengths) < 12:
        length = draw(st.integers(0, room))
        lengths.append(length)
        room -= length
    return domain, cost, size, lengths


@settings(max_examples=scaled(400), deadline=None)
@given(groups())
def test_no_group_holds_more_shares_than_its_ring_costs(case):
    """The feasibility the share bound rests on, for any group a plan may hold: token budget
    kept, every sample's minimum CP size at most the group's, node tiers included."""
    domain, cost, size, lengths = case
    shares = ring_shares(domain, cost)
    total = sum(share(shares, domain, L) for L in lengths)
    assert total <= size * cost.ring_cost(size) * (1 + 1e-9) + 1e-9


@settings(max_examples=scaled(200), deadline=None)
@given(groups())
def test_shares_are_at_least_the_fluid_ones(case):
    domain, cost, _, lengths = case
    shares = ring_shares(domain, cost)
    for L in lengths:
        fluid = L * cost.ring_cost(domain.cp_degree(L)) / domain.budget
        assert share(shares, domain, L) >= fluid * (1 - 1e-9) - 1e-9


def test_one_long_sample_per_microbatch_is_priced_exactly():
    """Two samples of budget + 1 tokens on two ranks: each needs both ranks, alone. The bound
    equals the critical path; the fluid ring term charges about half of each group's ring."""
    domain, lengths = Domain(2, 1, 100), [101, 101]
    cost = CostModel(1.0, 0.01, comm=0.2, ring_step=50.0, microbatch=3.0)
    plan = scheduler(2, 100, cost).schedule(lengths)
    assert lower_bound(plan, cost) == pytest.approx(critical_path(plan, cost))
    shares = ring_shares(domain, cost)
    assert sum(share(shares, domain, L) for L in lengths) == pytest.approx(4 * 50.0)
    assert fluid_ring(lengths, domain, cost) == pytest.approx(2 * 101 * 50.0 / 100)


def test_few_samples_pay_their_coverage():
    """VPP 4 over 4 short samples on 8 ranks: each micro-batch holds one sample on one group
    of 8. Coverage gives exactly that ring cost; the shares (CP 1 samples) give none."""
    domain, lengths = Domain(8, 1, 100), [10, 20, 30, 40]
    assert fewest_microbatches(lengths, domain, 4) == 4
    assert coverage_ring(4, 4, 8, RING) == pytest.approx(4 * 8 * RING.ring_cost(8))
    plan = scheduler(8, 100, RING, vpp=4).schedule(lengths)
    assert lower_bound(plan, RING) == pytest.approx(critical_path(plan, RING))
    assert sum(share(ring_shares(domain, RING), domain, L) for L in lengths) == 0.0


def test_no_coverage_once_every_rank_can_hold_its_own_sample():
    assert coverage_ring(64, 2, 32, RING) == 0.0
    assert coverage_ring(0, 0, 8, RING) == 0.0


def test_fewest_microbatches_rounds_up_to_the_vpp_group():
    domain = Domain(4, 1, 10)
    assert fewest_microbatches([40, 1], domain, None) == 2
    assert fewest_microbatches([40, 1], domain, 4) == 4
    assert fewest_microbatches([0, 0], domain, None) == 1  # a sample needs a micro-batch
    assert fewest_microbatches([], domain, 2) == 0
    cost = CostModel(1.0, 0.0, microbatch=7.0)
    assert batch_lower_bound([40, 1], domain, cost, 4) - batch_lower_bound(
        [40, 1], domain, cost, None
    ) == pytest.approx(2 * 7.0)


def test_shares_fall_back_to_the_fluid_ones_where_the_proof_fails():
    """On 10 ranks the whole-domain group costs little more than a group of 8: the largest share
    per token of a size-8 sample, times 10 budgets, exceeds what a group of 10 pays, so the
    proof does not hold and every size gets the fluid share."""
    domain = Domain(10, 1, 100)
    shares = ring_shares(domain, RING)
    assert shares == {c: (0.0, RING.ring_cost(c) / 100) for c in domain.group_sizes}
    powers = ring_shares(Domain(8, 1, 100), RING)
    assert powers[8][0] > 0  # power-of-two domains keep the exclusive shares


# ------------------------------------------------------------------------------------------------
# An odd half-domain sample: the idle half (``unpaired_half_idle``)
# ------------------------------------------------------------------------------------------------

# Scaled for the tiny domains below (budgets of 1–50 tokens): coefficients of one order, and a
# score cache of 50 elements, so that spill bites (``cost_models(spill=True)`` caches 1e4).
SPILL_COSTS = st.builds(
    CostModel,
    linear=st.floats(0.01, 2.0),
    quadratic=st.floats(0.0, 0.1),
    comm=st.floats(0.0, 3.0),
    ring_step=st.floats(0.0, 50.0),
    cp_efficiency=st.floats(0.3, 1.0),
    microbatch=st.floats(0.0, 20.0),
    spill=st.sampled_from([0.0, 0.0, 0.01]),
    spill_elements=st.sampled_from([math.inf, 50.0]),
)


@settings(max_examples=scaled(300), deadline=None)
@given(st.data(), SPILL_COSTS)
def test_no_group_of_shorter_samples_exceeds_the_cap(data, cost):
    """The cap the idle half rests on: any group of at most N/2 ranks holding shorter samples
    (each within its minimum CP size, the group within the budget) costs at most the cap."""
    n = data.draw(st.sampled_from([2, 4, 8, 16]))
    domain = Domain(n, 1, data.draw(st.integers(1, 50)))
    limit = n * domain.budget // 4  # shorter samples: not half-domain ones
    shorter = data.draw(st.lists(st.integers(0, max(limit, 0)), min_size=1, max_size=12))
    degree = domain.cp_degrees(shorter)
    size = data.draw(st.sampled_from([c for c in domain.group_sizes if c <= n // 2]))
    members = [i for i, L in enumerate(shorter) if degree[L] <= size]
    assume(members)
    chosen = data.draw(st.lists(st.sampled_from(members), min_size=1, max_size=6, unique=True))
    picked = [shorter[i] for i in chosen]
    assume(sum(picked) <= size * domain.budget)
    cap = shorter_group_cap(Counter(shorter), degree, domain, cost)
    assert cost.group_cost(picked, size) <= cap * (1 + 1e-9) + 1e-9


def test_an_odd_half_domain_sample_idles_the_other_half():
    """Two ranks, budget 100: a 90-token sample needs a rank to itself or both ranks (paying
    the K/V exchange). Beside a 10-token sample the other rank idles 80 tokens' time: the bound
    charges exactly that, and equals the best plan's critical path (before: 50 vs 90)."""
    domain, lengths = Domain(2, 1, 100), [90, 10]
    cost = CostModel(1.0, 0.0, comm=1.0)
    assert unpaired_half_idle(Counter(lengths), domain, cost) == pytest.approx(80.0)
    assert unpaired_half_idle(Counter([90, 60, 10]), domain, cost) == 0.0  # a pair: nothing charged
    plan = scheduler(2, 100, cost).schedule(lengths)
    assert critical_path(plan, cost) == pytest.approx(90.0)
    assert lower_bound(plan, cost) == pytest.approx(90.0)


def aligned_layouts(start: int, size: int, most: int):
    """Every partition of the block [start, start + size) into aligned power-of-two blocks of
    at most ``most`` blocks, as lists of (start, size)."""
    if most < 1:
        return
    yield [(start, size)]
    if size > 1:
        half = size // 2
        for left in aligned_layouts(start, half, most - 1):
            for right in aligned_layouts(start + half, half, most - len(left)):
                yield left + right


def best_microbatch(lengths, domain, cost):
    """The least peak of one micro-batch holding ``lengths``: every layout of aligned groups and
    every way to fill each group with one sample at least within its budget and minimum sizes."""
    best = math.inf
    for layout in aligned_layouts(0, domain.size, len(lengths)):
        for places in itertools.product(range(len(layout)), repeat=len(lengths)):
            held = [[L for L, p in zip(lengths, places) if p == g] for g in range(len(layout))]
            if any(
                not group
                or sum(group) > size * domain.budget
                or max(domain.cp_degree(L) for L in group) > size
                for group, (_, size) in zip(held, layout)
            ):
                continue
            best = min(best, max(cost.group_cost(g, s) for g, (_, s) in zip(held, layout)))
    return best


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first]] + partition
        for i in range(len(partition)):
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1 :]


@settings(max_examples=scaled(150), deadline=None)
@given(st.data(), SPILL_COSTS)
def test_the_bound_is_below_the_optimum_of_tiny_batches(data, cost):
    """Against the optimum itself (every plan of 1–4 samples on 2, 4 or 8 ranks enumerated),
    with an odd count of half-domain samples half the time: the bound never exceeds it."""
    n = data.draw(st.sampled_from([2, 4, 8]))
    domain = Domain(n, 1, data.draw(st.integers(2, 20)))
    half = st.integers(n * domain.budget // 4 + 1, n * domain.budget // 2)
    any_length = st.integers(0, n * domain.budget)
    lengths = data.draw(st.lists(st.one_of(half, any_length), min_size=1, max_size=4))
    optimum = min(
        sum(best_microbatch(part, domain, cost) + cost.microbatch for part in partition)
        for partition in set_partitions(lengths)
    )
    assert batch_lower_bound(lengths, domain, cost) <= optimum * (1 + 1e-9) + 1e-9
