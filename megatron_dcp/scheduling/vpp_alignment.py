"""Step 6 of ``default_dynamic_cp``: ``align_to_vpp`` makes the micro-batch count a multiple of
the VPP group size (``microbatch_group_size_per_vp_stage``) by splitting micro-batches, each
split in place (both halves keep the micro-batch's blocks) or afresh (halves of equal work laid
out again), whichever adds least to the critical path; or, with more micro-batches than any
such multiple allows, from whole-domain micro-batches."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.balance import lpt_partition
from megatron_dcp.scheduling.buddy import BuddyAllocator
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import GroupDraft, Item, group_of_items
from megatron_dcp.scheduling.dynamic_cp_context import Context, Row
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.microbatch_forming import heaviest_first, next_hdp_group
from megatron_dcp.scheduling.row_refinement import fill_empty_ranks, rebalance_row


def align_to_vpp(
    ctx: Context, rows: List[Row], items: Sequence[Item], vpp: Optional[int]
) -> List[Row]:
    """Step 6: make the micro-batch count a multiple of ``vpp`` by splitting micro-batches. When
    the count already exceeds the largest such multiple ≤ the sample count, start again from
    whole-domain micro-batches (first-fit decreasing), or raise when even those are too many."""
    if not vpp or len(rows) % vpp == 0:
        return rows
    limit = len(items) - len(items) % vpp
    if len(rows) > limit:
        rows = whole_domain_rows(ctx, items, vpp, limit)
    while len(rows) % vpp:
        split_row(ctx, rows)
    return rows


def whole_domain_rows(ctx: Context, items: Sequence[Item], vpp: int, limit: int) -> List[Row]:
    """Whole-domain micro-batches packed first-fit decreasing by length; ValueError (naming the
    VPP flag) when more than ``limit`` are needed."""
    capacity = ctx.domain.size * ctx.domain.budget
    bins: List[List[Item]] = []
    room: List[int] = []
    for item in sorted(items, key=lambda it: (-it.seqlen, it.sample_id)):
        index = next((i for i, left in enumerate(room) if item.seqlen <= left), len(bins))
        if index == len(bins):
            bins.append([])
            room.append(capacity)
        bins[index].append(item)
        room[index] -= item.seqlen
    if len(bins) > limit:
        raise SchedulingError(
            "{vpp}={k}: the micro-batch count must be a multiple of {k} and at most the sample "
            "count ({count}), but these samples need at least {needed} micro-batches of "
            "{capacity} tokens; use {batch}, a smaller {vpp} or a larger {budget}.",
            k=vpp,
            count=len(items),
            needed=len(bins),
            capacity=capacity,
        )
    return [[group_of_items(ctx.domain.root(), bin_items, ctx.cost)] for bin_items in bins]


def split_row(ctx: Context, rows: List[Row]) -> None:
    """Replace one micro-batch (≥ 2 samples) by two: of the micro-batch with the most samples and
    the lightest one, each split in place (:func:`split_in_place`) or into halves of equal work
    laid out afresh (:func:`split_halves`), the split that adds the least to the critical path."""
    splittable = [i for i, row in enumerate(rows) if sum(len(g.items) for g in row) >= 2]
    assert splittable, "a VPP split needs a micro-batch with two samples"
    fullest = max(splittable, key=lambda i: (sum(len(g.items) for g in rows[i]), -i))
    lightest = min(splittable, key=lambda i: (max(g.load for g in rows[i]), i))
    options = [
        (index, halves)
        for index in dict.fromkeys((fullest, lightest))
        for halves in (split_in_place(ctx, rows[index]), split_halves(ctx, rows[index]))
        if halves is not None
    ]
    index, halves = min(options, key=lambda o: (split_growth(rows[o[0]], o[1]), o[0]))
    rows[index : index + 1] = halves


def split_in_place(ctx: Context, row: Row) -> Optional[List[Row]]:
    """``row`` as two micro-batches over its own blocks: the samples of each group holding
    several are dealt to the two halves (heaviest first, to the lighter side); a group of one
    sample goes whole to the half whose such groups weigh less, leaving its block free in the
    other, where :func:`fill_empty_ranks` fills it. None when a half would be left without a
    group (the micro-batch is one group of one non-empty sample)."""
    halves: Tuple[Row, Row] = ([], [])
    holes: Tuple[List[Block], List[Block]] = ([], [])
    whole = [0.0, 0.0]
    for group in sorted(row, key=lambda g: (-g.load, g.block.start)):
        parts = deal(ctx, group)
        if parts is None:
            side = 0 if whole[0] <= whole[1] else 1
            whole[side] += group.load
            parts = (group.items, []) if side == 0 else ([], group.items)
        for side, items in enumerate(parts):
            if items:
                halves[side].append(group_of_items(group.block, items, ctx.cost))
            else:
                holes[side].append(group.block)
    if not all(halves):
        return None  # a single group of one sample: no split in place
    for groups, blocks in zip(halves, holes):
        free = BuddyAllocator(ctx.domain)
        free.free = blocks
        fill_empty_ranks(ctx, groups, free)
        rebalance_row(ctx, groups)
    return list(halves)


def deal(ctx: Context, group: GroupDraft) -> Optional[Tuple[List[Item], List[Item]]]:
    """The samples of ``group`` in two parts of near-equal load: the two longest open them (both
    non-empty), each other sample goes to the lighter part; None with fewer than two non-empty
    samples."""
    items = sorted(group.items, key=lambda it: (-it.seqlen, it.sample_id))
    if len(items) < 2 or items[1].seqlen == 0:
        return None
    parts = ([items[0]], [items[1]])
    loads = [ctx.load(items[0].seqlen, group.size), ctx.load(items[1].seqlen, group.size)]
    for item in items[2:]:
        side = 0 if loads[0] <= loads[1] else 1
        parts[side].append(item)
        loads[side] += ctx.load(item.seqlen, group.size)
    return parts


def split_halves(ctx: Context, row: Row) -> List[Row]:
    """The samples of ``row`` in two halves of equal work, each laid out as one micro-batch."""
    items = [item for group in row for item in group.items]
    capacity = ctx.domain.size * ctx.domain.budget
    halves = lpt_partition(items, 2, capacity, ctx.min_work)
    assert halves is not None and all(halves)
    return [single_row(ctx, heaviest_first(ctx, half)) for half in halves]


def split_growth(row: Row, halves: Sequence[Row]) -> float:
    """How much replacing ``row`` by ``halves`` adds to Σ peaks."""
    return sum(max(g.load for g in half) for half in halves) - max(g.load for g in row)


def single_row(ctx: Context, items: List[Item]) -> Row:
    """``items`` as one micro-batch: laid out by :func:`next_hdp_group` when everything fits,
    else one whole-domain group (their tokens fit the domain)."""
    row, leftovers = next_hdp_group(ctx, items)
    return row if not leftovers else [group_of_items(ctx.domain.root(), items, ctx.cost)]
