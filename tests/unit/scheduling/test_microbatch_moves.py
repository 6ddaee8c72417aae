"""The search inside a micro-batch (``dynamic_cp.microbatch_search``: shifts, redeals, merges and
splits around its top group): hand-made cases with known answers, and properties over random
micro-batches (the peak never grows, the ranks stay a partition, every sample stays)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import cases, scaled

from megatron_dcp.scheduling import CostModel, Domain
from megatron_dcp.scheduling.domain import Block, is_power_of_two
from megatron_dcp.scheduling.draft import Item, group_of_items
from megatron_dcp.scheduling.dynamic_cp.construction import formed_plan
from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import heaviest_first
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import (
    improve_microbatch,
    polish_microbatch,
)
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import Candidate
from megatron_dcp.scheduling.dynamic_cp.search_state import Context

LINEAR = CostModel(1.0, 0.0)


def make_draft(ctx, layout):
    """One micro-batch from [(block start, size, [lengths]), ...]; ids in order of appearance."""
    draft, ids = [], iter(range(1000))
    for start, size, lengths in layout:
        items = [Item(next(ids), length, ctx.domain.cp_degree(length)) for length in lengths]
        draft.append(group_of_items(Block(start, size), items, ctx.cost))
    return draft


def peak(draft):
    return max(group.load for group in draft)


def shape(draft):
    return sorted((group.size, sorted(item.seqlen for item in group.items)) for group in draft)


def test_the_driver_makes_only_moves_that_end_below_the_top():
    """One acceptance rule inside a micro-batch, applied by the driver whatever a finder
    returns: a candidate whose peak reaches the top's load is refused; the next finder's, below
    it, is made."""
    ctx = Context(Domain(3, 1, 100), LINEAR)
    draft = make_draft(ctx, [(0, 1, [60, 30]), (1, 1, [10]), (2, 1, [50])])
    made = []

    def level(ctx, draft, top):
        return Candidate(top.load, lambda: made.append("level"))

    def lower(ctx, draft, top):
        return None if made else Candidate(top.load - 1, lambda: made.append("lower"))

    assert improve_microbatch(ctx, draft, (level, lower), steps=3)
    assert made == ["lower"]
    assert not improve_microbatch(ctx, draft, (level,), steps=3)


def test_a_sample_shifts_from_the_top_group_to_a_light_one():
    """Three ranks (no merges or splits off a power of two): moving the 30 gives 60, 40, 50."""
    ctx = Context(Domain(3, 1, 100), LINEAR)
    draft = make_draft(ctx, [(0, 1, [60, 30]), (1, 1, [10]), (2, 1, [50])])
    assert polish_microbatch(ctx, draft)
    assert peak(draft) == 60
    assert shape(draft) == [(1, [10, 30]), (1, [50]), (1, [60])]


def test_a_lone_sample_trades_places_with_a_shorter_one():
    """70 alone can only trade, and every trade leaves a rank at 70 or more; 50 + 40 trades its 40
    for the 10 (60, 60, 60), better than moving it or trading it for the 20 (70)."""
    ctx = Context(Domain(3, 1, 100), LINEAR)
    draft = make_draft(ctx, [(0, 1, [70]), (1, 1, [20, 10]), (2, 1, [5])])
    assert not polish_microbatch(ctx, draft)
    draft = make_draft(ctx, [(0, 1, [50, 40]), (1, 1, [20, 10]), (2, 1, [60])])
    polish_microbatch(ctx, draft)
    assert peak(draft) == 60


def test_two_heavy_groups_merge_when_the_larger_group_levels_them():
    """Per-rank costs halve on twice the ranks: 90 + 30 on four ranks cost 60 + ring 2 per rank,
    below the 90 alone on two; the light groups then stay under it."""
    cost = CostModel(1.0, 0.0, ring_step=1.0)
    ctx = Context(Domain(8, 1, 100), cost)
    draft = make_draft(ctx, [(0, 2, [180]), (2, 2, [60]), (4, 2, [100]), (6, 2, [100])])
    assert peak(draft) == 91
    polish_microbatch(ctx, draft)
    assert peak(draft) < 91
    assert sorted(group.size for group in draft) == [2, 2, 4]
    assert [(g.block.start, g.size) for g in draft] == [(0, 4), (4, 2), (6, 2)]


def test_a_group_of_short_samples_splits_when_its_ring_steps_dominate():
    cost = CostModel(1.0, 0.0, ring_step=50.0)
    ctx = Context(Domain(4, 1, 100), cost)
    draft = make_draft(ctx, [(0, 4, [40, 40, 40, 40])])
    before = peak(draft)
    polish_microbatch(ctx, draft)
    assert peak(draft) < before
    assert sum(group.size for group in draft) == 4
    assert all(group.size < 4 for group in draft)


def test_no_merge_or_split_on_a_non_power_of_two_domain():
    cost = CostModel(1.0, 0.0, ring_step=1.0)
    ctx = Context(Domain(6, 1, 100), cost)
    draft = make_draft(ctx, [(0, 4, [200, 100]), (4, 2, [100])])
    polish_microbatch(ctx, draft)
    assert sorted(group.size for group in draft) == [2, 4]


@settings(max_examples=scaled(150), deadline=None)
@given(data=st.data(), ring=st.floats(0.0, 200.0), comm=st.floats(0.0, 0.2))
def test_polishing_never_raises_a_peak_and_keeps_the_partition(data, ring, comm):
    case = data.draw(cases("default_dynamic_cp"))
    domain = Domain(case.size, case.min_cp_size, case.budget)
    cost = CostModel(1.0, 0.001, comm=comm, ring_step=ring, cp_efficiency=0.9)
    ctx = Context(domain, cost)
    if not case.seqlens or max(case.seqlens) > domain.max_tokens_per_sequence:
        return
    items = [Item(i, n, domain.cp_degree(n)) for i, n in enumerate(case.seqlens)]
    for draft in formed_plan(ctx, heaviest_first(ctx, items)):
        before, ids = peak(draft), Counter(it.sample_id for g in draft for it in g.items)
        worked = sum(1 for group in draft if group.tokens > 0)
        polish_microbatch(ctx, draft)
        assert peak(draft) <= before * (1 + 1e-9)
        assert Counter(it.sample_id for g in draft for it in g.items) == ids
        covered = sorted(p for group in draft for p in group.block.positions)
        assert covered == list(range(domain.size))
        assert all(domain.is_group_block(group.block) for group in draft)
        for group in draft:
            assert group.tokens <= group.size * domain.budget
            assert all(item.min_cp <= group.size for item in group.items)
            assert abs(
                group.load - cost.group_cost([i.seqlen for i in group.items], group.size)
            ) <= (1e-6 * max(1.0, group.load))
        assert sum(1 for group in draft if group.tokens > 0) >= min(worked, 1)
        if not is_power_of_two(domain.size):
            assert all(group.items for group in draft)
