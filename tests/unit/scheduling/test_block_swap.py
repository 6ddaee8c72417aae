"""Swapping two CP blocks between micro-batches (``dynamic_cp.moves.block_swap``, driven by
``plan_search.improve_plan``): a hand-made case with a known answer, a swap that would not pay
refused, and a property over random plans (Σ peaks never grows, every sample and every block
stays)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import rank_drafts

from megatron_dcp.scheduling import CostModel, Domain
from megatron_dcp.scheduling.dynamic_cp.moves.block_swap import BlockSwap
from megatron_dcp.scheduling.dynamic_cp.plan_search import improve_plan
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, peak

LINEAR = CostModel(1.0, 0.0, name="linear")


def peaks(drafts):
    return [peak(draft) for draft in drafts]


def test_a_lone_heavy_group_joins_the_heavy_micro_batch():
    """Micro-batch 0 runs at 100 for one group; micro-batch 1 at 90 with a light group of 20:
    trading those two groups makes the plan 100 + 20 instead of 100 + 90."""
    ctx = Context(Domain(3, 1, 100), LINEAR)
    drafts = rank_drafts(ctx, [[[100], [10], [10]], [[90], [90], [20]]])
    improve_plan(ctx, drafts, BlockSwap)
    assert sorted(peaks(drafts)) == [20, 100]


def test_a_swap_that_does_not_lower_the_peaks_is_refused():
    ctx = Context(Domain(2, 1, 100), LINEAR)
    drafts = rank_drafts(ctx, [[[100], [90]], [[50], [40]]])
    improve_plan(ctx, drafts, BlockSwap)
    assert peaks(drafts) == [100, 50]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.lists(st.integers(1, 100), min_size=1, max_size=3), min_size=4, max_size=4),
        min_size=2,
        max_size=5,
    )
)
def test_peaks_never_grow_and_samples_and_blocks_stay(layout):
    ctx = Context(Domain(4, 1, 300), LINEAR)
    drafts = rank_drafts(ctx, layout)
    before = sum(peaks(drafts))
    samples = Counter(item for draft in drafts for g in draft for item in g.items)
    blocks = [sorted(g.block.start for g in draft) for draft in drafts]
    improve_plan(ctx, drafts, BlockSwap)
    assert sum(peaks(drafts)) <= before
    assert Counter(item for draft in drafts for g in draft for item in g.items) == samples
    assert [sorted(g.block.start for g in draft) for draft in drafts] == blocks
    for draft in drafts:
        for group in draft:
            assert group.load == sum(item.seqlen for item in group.items)
