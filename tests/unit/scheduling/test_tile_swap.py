"""Swapping two tiled blocks between micro-batches (``dynamic_cp.moves.tile_swap``, driven by
``plan_search.improve_plan``): a hand-made case with a known answer that block swaps cannot
reach, a swap that would not pay refused, and a property over random tilings of power-of-two and
other domains (Σ peaks never grows, every sample stays, each micro-batch's groups still tile the
domain on aligned blocks, loads stay exact)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dcp.scheduling import CostModel, Domain
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import Item, group_of_items
from megatron_dcp.scheduling.dynamic_cp.moves.block_swap import BlockSwap
from megatron_dcp.scheduling.dynamic_cp.moves.tile_swap import TileSwap
from megatron_dcp.scheduling.dynamic_cp.plan_search import improve_plan
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, peak

LINEAR = CostModel(1.0, 0.0, name="linear")


def drafts_of(ctx, layout):
    """Draft micro-batches from [[(start, size, [lengths]), ...], ...]; ids in order."""
    ids = iter(range(10_000))
    return [
        [
            group_of_items(Block(start, size), [Item(next(ids), n, 1) for n in lengths], ctx.cost)
            for start, size, lengths in groups
        ]
        for groups in layout
    ]


def peaks(drafts):
    return [peak(draft) for draft in drafts]


def test_a_heavy_pair_trades_places_with_two_light_groups():
    """Micro-batch 0 peaks at 100 on a 2-rank group; micro-batch 1 at 90 on ranks 0 and 1 and
    runs ranks 2-3 as two light 1-rank groups. No group of size 2 exists in micro-batch 1, so a
    block swap finds nothing; trading the 2-rank block for ranks 2-3 makes the plan 30 + 100."""
    ctx = Context(Domain(4, 1, 1000), LINEAR)
    layout = [
        [(0, 2, [200]), (2, 1, [30]), (3, 1, [30])],
        [(0, 1, [90]), (1, 1, [90]), (2, 1, [10]), (3, 1, [10])],
    ]
    drafts = drafts_of(ctx, layout)
    improve_plan(ctx, drafts, BlockSwap)
    assert peaks(drafts) == [100, 90]
    improve_plan(ctx, drafts, TileSwap)
    assert peaks(drafts) == [30, 100]
    assert sorted((g.block, g.items[0].seqlen) for g in drafts[1]) == [
        (Block(0, 1), 90),
        (Block(1, 1), 90),
        (Block(2, 2), 200),
    ]
    assert sorted(g.block.start for g in drafts[0]) == [0, 1, 2, 3]


def test_a_swap_that_does_not_lower_the_peaks_is_refused():
    ctx = Context(Domain(4, 1, 1000), LINEAR)
    layout = [
        [(0, 2, [200]), (2, 1, [30]), (3, 1, [30])],
        [(0, 1, [90]), (1, 1, [95]), (2, 1, [95]), (3, 1, [95])],
    ]
    drafts = drafts_of(ctx, layout)
    improve_plan(ctx, drafts, TileSwap)
    assert peaks(drafts) == [100, 95]


@st.composite
def tilings(draw, ranks):
    """Groups tiling ``ranks`` ranks on aligned power-of-two blocks (or one whole-domain group),
    each holding 1-2 samples."""
    if draw(st.integers(0, 9)) == 0:
        blocks = [(0, ranks)]
    else:
        blocks, start = [], 0
        while start < ranks:  # the largest aligned blocks first, then split at random
            size = 1 << (ranks - start).bit_length() - 1
            while start % size:
                size //= 2
            stack = [(start, size)]
            while stack:
                at, size_here = stack.pop()
                if size_here > 1 and draw(st.booleans()):
                    half = size_here // 2
                    stack += [(at + half, half), (at, half)]
                else:
                    blocks.append((at, size_here))
            start += size
    lengths = st.lists(st.integers(1, 100), min_size=1, max_size=2)
    return [(at, size, [n * size for n in draw(lengths)]) for at, size in blocks]


@settings(max_examples=80, deadline=None)
@given(st.data(), st.sampled_from([4, 6, 8, 10, 12]), st.integers(2, 5))
def test_peaks_never_grow_samples_stay_and_blocks_tile(data, ranks, count):
    ctx = Context(Domain(ranks, 1, 1000), LINEAR)
    drafts = drafts_of(ctx, [data.draw(tilings(ranks)) for _ in range(count)])
    before = sum(peaks(drafts))
    samples = Counter(item for draft in drafts for g in draft for item in g.items)
    improve_plan(ctx, drafts, TileSwap)
    assert sum(peaks(drafts)) <= before
    assert Counter(item for draft in drafts for g in draft for item in g.items) == samples
    for draft in drafts:
        covered = sorted(rank for g in draft for rank in range(g.block.start, g.block.stop))
        assert covered == list(range(ranks))
        for group in draft:
            assert ctx.domain.is_group_block(group.block)
            assert group.load == sum(item.seqlen for item in group.items) / group.size
