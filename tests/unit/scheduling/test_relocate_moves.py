"""Relocate, swap and tie-break across micro-batches (``dynamic_cp.moves.relocate``, driven by
``plan_search.improve_plan``) and the in-place VPP split: hand-made cases with known answers, and
properties over random batches (the critical path never grows, the blocks and the samples
stay)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import cases, rank_drafts, scaled

from megatron_dcp.scheduling import CostModel, Domain, build_scheduler
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import Item, group_of_items
from megatron_dcp.scheduling.dynamic_cp.construction import formed_plan
from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import heaviest_first
from megatron_dcp.scheduling.dynamic_cp.moves.relocate import Relocate, TieBreak
from megatron_dcp.scheduling.dynamic_cp.plan_search import improve_plan
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, draft_critical_path
from megatron_dcp.scheduling.dynamic_cp.vpp_alignment import split_in_place

LINEAR = CostModel(1.0, 0.0)


def peaks(drafts):
    return [max(group.load for group in draft) for draft in drafts]


def test_a_sample_moves_from_a_top_group_into_slack_of_another_micro_batch():
    """Moving 30 onto the 10 gives 60 + 40 (so does swapping 60 with the 10): the optimum."""
    ctx = Context(Domain(2, 1, 100), LINEAR)
    drafts = rank_drafts(ctx, [[[60, 30], [40]], [[40], [10]]])
    assert sum(peaks(drafts)) == 130
    improve_plan(ctx, drafts, Relocate)
    assert sum(peaks(drafts)) == 100


def test_the_best_exchange_wins():
    """Moving 30 would give 60 + 50; swapping 60 with a 20 gives 100 (the optimum)."""
    ctx = Context(Domain(2, 1, 100), LINEAR)
    drafts = rank_drafts(ctx, [[[60, 30], [40]], [[20], [20, 20]]])
    improve_plan(ctx, drafts, Relocate)
    assert sum(peaks(drafts)) == 100


def test_a_lone_sample_is_swapped_with_a_shorter_one():
    """The top group holds one sample: only a swap can lower it (90 for 50: 50 + 90); then the
    30 trades places with the 50 (30 + 100)."""
    ctx = Context(Domain(2, 1, 100), LINEAR)
    drafts = rank_drafts(ctx, [[[90], [10]], [[50], [50, 30]]])
    improve_plan(ctx, drafts, Relocate)
    assert sum(peaks(drafts)) == 130
    assert [[it.seqlen for it in g.items] for g in drafts[0]] == [[30], [10]]


def test_a_top_group_tied_with_another_sheds_first_without_gain():
    """60 and 60 tie: moving a 10 from either leaves the peak at 60, but it costs nothing (the
    other micro-batch's 10 + 10 stays under its 40); then the other 10 moves too (100 -> 90)."""
    ctx = Context(Domain(2, 1, 100), LINEAR)
    drafts = rank_drafts(ctx, [[[50, 10], [50, 10]], [[40], [10]]])
    improve_plan(ctx, drafts, Relocate)
    assert peaks(drafts) == [60, 40]  # ties are broken only when asked
    improve_plan(ctx, drafts, TieBreak)
    assert peaks(drafts) == [50, 40]


def test_no_exchange_when_the_receiving_group_has_no_room():
    ctx = Context(Domain(2, 1, 60), LINEAR)
    drafts = rank_drafts(ctx, [[[30, 30], [20]], [[30, 30], [60]]])
    improve_plan(ctx, drafts, Relocate)
    assert peaks(drafts) == [60, 60]


def test_no_swap_past_the_token_budget():
    """Swapping the 96 for the 40 would give 40 + 123 but put 246 tokens on a group of two ranks
    with budget 100; moving the 40 onto the 10 gives 96 + 75."""
    ctx = Context(Domain(2, 1, 100), LINEAR)
    (draft,) = rank_drafts(ctx, [[[96], [10]]])
    pair = [Item(10, 150, 2), Item(11, 40, 1)]
    drafts = [draft, [group_of_items(Block(0, 2), pair, LINEAR)]]
    improve_plan(ctx, drafts, Relocate)
    assert peaks(drafts) == [96, 75]
    assert all(g.tokens <= g.size * 100 for r in drafts for g in r)


def row_signature(draft):
    return sorted((group.block.start, group.size) for group in draft)


@settings(max_examples=scaled(150), deadline=None)
@given(data=st.data(), ring=st.floats(0.0, 200.0), quadratic=st.floats(0.0, 0.01))
def test_exchanges_never_lengthen_the_critical_path(data, ring, quadratic):
    case = data.draw(cases("default_dynamic_cp"))
    domain = Domain(case.size, case.min_cp_size, case.budget)
    ctx = Context(domain, CostModel(1.0, quadratic, ring_step=ring, microbatch=10.0))
    if not case.seqlens or max(case.seqlens) > domain.max_tokens_per_sequence:
        return
    items = [Item(i, n, domain.cp_degree(n)) for i, n in enumerate(case.seqlens)]
    drafts = formed_plan(ctx, heaviest_first(ctx, items))
    before = draft_critical_path(ctx, drafts)
    layout = [row_signature(draft) for draft in drafts]
    held = [[group.tokens > 0 for group in draft] for draft in drafts]
    improve_plan(ctx, drafts, Relocate)
    assert draft_critical_path(ctx, drafts) <= before * (1 + 1e-9)
    assert [row_signature(draft) for draft in drafts] == layout
    assert Counter(it.sample_id for r in drafts for g in r for it in g.items) == Counter(
        range(len(items))
    )
    for draft, had in zip(drafts, held):
        for group, tokens in zip(draft, had):
            assert group.tokens <= group.size * domain.budget
            assert all(item.min_cp <= group.size for item in group.items)
            assert group.tokens > 0 or not tokens  # a group with work keeps work


def test_an_in_place_split_halves_every_group_of_a_full_micro_batch():
    ctx = Context(Domain(4, 1, 100), LINEAR)
    (draft,) = rank_drafts(ctx, [[[10, 10, 10, 10]] * 4])
    halves = split_in_place(ctx, draft)
    assert [peaks([half]) for half in halves] == [[20], [20]]
    assert all(row_signature(half) == row_signature(draft) for half in halves)


def test_an_in_place_split_fills_the_blocks_a_lone_sample_leaves_free():
    ctx = Context(Domain(4, 1, 100), LINEAR)
    (draft,) = rank_drafts(ctx, [[[40], [40], [10, 10, 10], [10, 10, 10]]])
    halves = split_in_place(ctx, draft)
    for half in halves:
        assert sum(group.size for group in half) == 4
        assert all(group.items and group.tokens > 0 for group in half)
    ids = sorted(it.sample_id for half in halves for g in half for it in g.items)
    assert ids == list(range(8))


def test_no_in_place_split_of_a_lone_sample():
    ctx = Context(Domain(4, 1, 100), LINEAR)
    draft = [group_of_items(Block(0, 4), [Item(0, 40, 1), Item(1, 0, 1)], LINEAR)]
    assert split_in_place(ctx, draft) is None


def test_vpp_split_of_one_group_micro_batches_on_a_non_power_of_two_domain():
    """Found by the edge-case properties: a micro-batch of one whole-domain group with one
    non-empty sample once made the in-place split fill a free domain forever."""
    lengths = [0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 0]
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=1,
        cp_size=6,
        max_seqlen_per_dp_cp_rank=1,
        min_cp_size=4,
        microbatch_group_size_per_vp_stage=4,
    )
    assert scheduler.schedule(lengths).validate().num_microbatches % 4 == 0
