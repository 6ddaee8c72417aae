"""Unit tests of the construction and alignment of ``default_dynamic_cp`` (``dynamic_cp``: its
scheduler module lists the phases) and of the VPP micro-batch count rule. Pure Python, no
hypothesis."""

import pytest

from megatron_dcp.scheduling import CostModel, Domain
from megatron_dcp.scheduling.balance import align_microbatch_count
from megatron_dcp.scheduling.buddy import BuddyAllocator
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import Item, group_of_items
from megatron_dcp.scheduling.dynamic_cp.construction import (
    equalize_buckets,
    formed_plan,
    is_heavy,
    promotion_waste,
)
from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import (
    fill_level,
    form_microbatch,
    heaviest_first,
    trial_sizes,
)
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import rebalance_microbatch
from megatron_dcp.scheduling.dynamic_cp.rank_repair import fill_empty_ranks
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, draft_critical_path
from megatron_dcp.scheduling.dynamic_cp.vpp_alignment import align_to_vpp

# Scheduling errors name the scheduling parameters (the flags come from the layers above).
VPP = "microbatch_group_size_per_vp_stage"
MODEL = CostModel.from_model_shape()


def covered(groups) -> list:
    return sorted(p for g in groups for p in g.block.positions)


# ------------------------------------------------------------------------------------------------
# The named steps of default_dynamic_cp
# ------------------------------------------------------------------------------------------------


def context(n: int = 8, budget: int = 100, min_cp: int = 1, cost: CostModel = MODEL) -> Context:
    return Context(Domain(n, 1, budget, min_cp), cost)


def items_of(ctx: Context, lengths) -> list:
    return [Item(i, length, ctx.domain.cp_degree(length)) for i, length in enumerate(lengths)]


@pytest.mark.parametrize(
    "count,group,aligned",
    [(5, None, 5), (5, 1, 5), (5, 4, 8), (8, 4, 8), (0, 4, 0), (1, 3, 3), (7, 2, 8), (9, 3, 9)],
)
def test_align_microbatch_count(count, group, aligned):
    assert align_microbatch_count(count, group) == aligned


def test_heaviest_first_orders_by_least_work_then_id():
    ctx = context(n=4, budget=100)
    items = items_of(ctx, [5, 300, 5, 0, 120])
    assert [i.sample_id for i in heaviest_first(ctx, items)] == [1, 4, 0, 2, 3]


def test_fill_level_is_the_mean_load_over_the_fewest_microbatches():
    ctx = context(n=4, budget=100, cost=CostModel.attention_only())
    items = items_of(ctx, [100] * 6)  # 600 tokens: 2 micro-batches of 400
    assert fill_level(ctx, items) == pytest.approx(6 * 100**2 / (4 * 2))
    assert fill_level(ctx, items_of(ctx, [0, 0])) == 0.0


def test_equalize_buckets_partitions_with_equal_work():
    ctx = context(n=4, budget=1000)
    lengths = [3000, 2500, 40, 40, 900, 1200, 17, 600, 600, 2000, 10, 1]
    items = items_of(ctx, lengths)
    buckets = equalize_buckets(ctx, heaviest_first(ctx, items))
    assert len(buckets) == 3 and all(buckets)  # ⌈10 908 tokens / 4000⌉
    assert sorted(i.sample_id for b in buckets for i in b) == list(range(len(items)))
    assert all(sum(i.seqlen for i in b) <= 4 * 1000 for b in buckets)
    works = [sum(ctx.min_work(i) for i in b) for b in buckets]
    assert max(works) - min(works) <= max(ctx.min_work(i) for i in items)  # LPT's guarantee


def test_equalize_buckets_adds_buckets_when_tokens_do_not_fit_and_spreads_zero_lengths():
    ctx = context(n=2, budget=10)
    assert len(equalize_buckets(ctx, items_of(ctx, [20, 20, 20]))) == 3  # 60 tokens, 20 each
    zeros = equalize_buckets(ctx, items_of(ctx, [0, 0, 0, 20, 20]))
    assert len(zeros) == 2 and all(zeros)


@pytest.mark.parametrize("n", [1, 3, 6, 8, 12])
@pytest.mark.parametrize("lengths", [[100, 3, 7], [90] * 20, [799, 400, 1, 1, 1, 250, 60, 0]])
def test_next_hdp_group_partitions_the_domain_and_returns_leftovers(n, lengths):
    ctx = context(n=n, budget=100)
    lengths = [min(length, n * 100) for length in lengths]
    items = heaviest_first(ctx, items_of(ctx, lengths))
    groups, leftovers = form_microbatch(ctx, items)
    placed = [i for g in groups for i in g.items]
    assert sorted(placed + leftovers, key=lambda i: i.sample_id) == sorted(
        items, key=lambda i: i.sample_id
    )
    assert groups and covered(groups) == list(range(n))
    assert [i.sample_id for i in leftovers] == [i.sample_id for i in items if i in leftovers]
    for g in groups:
        assert g.items and ctx.domain.is_group_block(g.block)
        assert g.tokens == sum(i.seqlen for i in g.items) <= g.size * 100
        assert all(i.min_cp <= g.size for i in g.items)
        assert g.load == pytest.approx(ctx.cost.group_cost([i.seqlen for i in g.items], g.size))


def test_next_hdp_group_fewer_samples_than_ranks_expands_groups():
    ctx = context(n=8, budget=64)
    groups, leftovers = form_microbatch(ctx, heaviest_first(ctx, items_of(ctx, [100, 3, 7])))
    assert not leftovers and covered(groups) == list(range(8))
    assert all(g.items for g in groups) and len(groups) <= 3


def test_next_hdp_group_gives_a_short_sequence_a_larger_group_when_that_balances():
    """Attention cost (no CP overhead): one long and many short samples; the long one is spread
    over more ranks than its minimum so that its group's load matches the others."""
    ctx = context(n=8, budget=1000, cost=CostModel.attention_only())
    items = heaviest_first(ctx, items_of(ctx, [1000] + [250] * 16))
    groups, leftovers = form_microbatch(ctx, items)
    long_group = next(g for g in groups if any(i.sample_id == 0 for i in g.items))
    assert long_group.size > 1 and not leftovers
    assert max(g.load for g in groups) < ctx.cost.per_rank(1000, 1)


def test_trial_sizes_start_at_the_size_that_meets_the_level():
    ctx = context(n=8, budget=1000, cost=CostModel.attention_only())
    item = Item(0, 100, 1)
    assert trial_sizes(ctx, item, floor=100**2) == [1]  # fits the level alone
    assert trial_sizes(ctx, item, floor=100**2 / 3) == [4, 2, 1]  # 10⁴/4 ≤ 10⁴/3 first
    assert trial_sizes(ctx, item, floor=0.0) == [8, 4, 2]


def test_trial_sizes_respect_min_cp_the_domain_and_rising_costs():
    six = context(n=6, budget=1000, cost=CostModel.attention_only())
    assert trial_sizes(six, Item(0, 100, 1), floor=0.0)[0] == 6  # whole non-power-of-two domain
    three = context(n=3, budget=4, min_cp=2)
    assert trial_sizes(three, Item(0, 0, 2), floor=0.0) == [3]  # size 2 cannot tile N = 3
    dear = context(n=8, budget=1000, cost=CostModel(linear=1.0, quadratic=0.0, comm=10.0))
    assert trial_sizes(dear, Item(0, 100, 1), floor=0.0) == [1]


def test_promotion_waste_and_is_heavy():
    ctx = context(n=8, budget=100)
    item = Item(0, 100, 1)
    load = ctx.cost.per_rank(100, 1)
    assert promotion_waste(ctx, item, load) == 0.0
    expected = ctx.alone(100, 2) * 2 / load - 1  # the ring steps count: the group holds it alone
    assert promotion_waste(ctx, item, ctx.alone(100, 2)) == pytest.approx(expected)

    def heavy(ctx, lengths):
        pool = items_of(ctx, lengths)
        return is_heavy(ctx, pool, fill_level(ctx, pool))

    assert not heavy(ctx, [100] * 8)
    attention = context(n=8, budget=100, cost=CostModel.attention_only())
    assert not heavy(attention, [800] + [1] * 8)  # CP is free there
    comm = context(n=8, budget=100, cost=CostModel(linear=1.0, quadratic=0.0, comm=1.0))
    assert heavy(comm, [100] + [1] * 100)


def test_fill_empty_ranks_takes_samples_from_groups_that_hold_several():
    ctx = context(n=4, budget=100, cost=CostModel.attention_only())
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(1), items_of(ctx, [10, 20, 30, 40]), ctx.cost)]
    fill_empty_ranks(ctx, groups, free)
    assert not free.free and covered(groups) == [0, 1, 2, 3]
    assert all(g.items for g in groups) and len(groups) == 3
    assert sorted(i.sample_id for g in groups for i in g.items) == [0, 1, 2, 3]


def test_fill_empty_ranks_merges_when_no_sample_can_be_spared():
    ctx = context(n=4, budget=100)
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(1), items_of(ctx, [10]), ctx.cost)]
    fill_empty_ranks(ctx, groups, free)
    assert [(g.block, [i.sample_id for i in g.items]) for g in groups] == [(Block(0, 4), [0])]


def test_fill_empty_ranks_takes_a_spare_sample_before_merging():
    ctx = context(n=4, budget=100)
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(2), items_of(ctx, [10]), ctx.cost)]
    spare = [Item(1, 300, 4), Item(2, 90, 1), Item(3, 5, 1)]  # heaviest first; 300 needs 4 ranks
    fill_empty_ranks(ctx, groups, free, spare)
    assert [(g.block, [i.sample_id for i in g.items]) for g in groups] == [
        (Block(0, 2), [0]),
        (Block(2, 2), [3]),  # the lightest spare that fits the free block
    ]
    assert [i.sample_id for i in spare] == [1, 2]


def test_fill_empty_ranks_reunites_free_buddies_before_merging_groups():
    ctx = context(n=4, budget=100)
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(2), items_of(ctx, [10]), ctx.cost)]
    free.free = [Block(2, 1), Block(3, 1)]  # buddies given back separately
    fill_empty_ranks(ctx, groups, free)
    assert [(g.block, [i.sample_id for i in g.items]) for g in groups] == [(Block(0, 4), [0])]
    assert all(g.items for g in groups)


def test_rebalance_row_lowers_the_maximum():
    ctx = context(n=2, budget=100, cost=CostModel.attention_only())
    free = BuddyAllocator(ctx.domain)
    heavy = group_of_items(free.allocate(1), items_of(ctx, [30, 30, 30]), ctx.cost)
    light = group_of_items(free.allocate(1), [Item(3, 1, 1)], ctx.cost)
    before = heavy.load
    rebalance_microbatch(ctx, [heavy, light])
    assert max(heavy.load, light.load) < before and len(heavy.items) == 2
    assert heavy.load == pytest.approx(2 * 30**2) and light.load == pytest.approx(30**2 + 1)


@pytest.mark.parametrize("vpp", [2, 3, 4])
def test_align_to_vpp_splits_microbatches(vpp):
    ctx = context(n=4, budget=100)
    items = items_of(ctx, [90, 80, 70, 60, 50, 40, 30, 20, 10, 5, 1, 0])
    drafts = formed_plan(ctx, heaviest_first(ctx, items))
    aligned = align_to_vpp(ctx, drafts, items, vpp)
    assert len(aligned) % vpp == 0 and len(aligned) >= len(drafts)
    assert sorted(i.sample_id for draft in aligned for g in draft for i in g.items) == list(
        range(12)
    )
    assert all(covered(draft) == [0, 1, 2, 3] and all(g.items for g in draft) for draft in aligned)
    assert draft_critical_path(ctx, aligned) > 0


def test_align_to_vpp_falls_back_to_whole_domain_microbatches_or_names_the_flag():
    ctx = context(n=1, budget=2)
    items = items_of(ctx, [2, 1, 1])  # 3 micro-batches laid out; 2 whole-domain ones suffice
    drafts = [[group_of_items(Block(0, 1), [item], ctx.cost)] for item in items]
    aligned = align_to_vpp(ctx, drafts, items, 2)
    assert [[i.sample_id for i in draft[0].items] for draft in aligned] == [[0], [1, 2]]
    full = items_of(ctx, [2, 2, 2])
    drafts = [[group_of_items(Block(0, 1), [item], ctx.cost)] for item in full]
    with pytest.raises(ValueError, match=VPP):
        align_to_vpp(ctx, drafts, full, 2)
    assert align_to_vpp(ctx, drafts, full, None) is drafts
