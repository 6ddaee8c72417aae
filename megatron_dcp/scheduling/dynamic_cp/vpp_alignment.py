"""Alignment: ``align_to_vpp`` makes the micro-batch count a multiple of
the VPP group size (``microbatch_group_size_per_vp_stage``) by splitting micro-batches, each
split in place (both halves keep the micro-batch's blocks) or afresh (halves of equal work laid
out again), whichever adds least to the critical path; or, with more micro-batches than any
such multiple allows, from whole-domain micro-batches."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.balance import lpt_partition
from megatron_dcp.scheduling.buddy import BuddyAllocator
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import GroupDraft, Item, group_of_items, longest_first
from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import form_microbatch, heaviest_first
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import rebalance_microbatch
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import deal
from megatron_dcp.scheduling.dynamic_cp.rank_repair import fill_empty_ranks
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft, peak
from megatron_dcp.scheduling.errors import SchedulingError


def align_to_vpp(
    ctx: Context, drafts: List[MicroBatchDraft], items: Sequence[Item], vpp: Optional[int]
) -> List[MicroBatchDraft]:
    """Make the micro-batch count a multiple of ``vpp`` by splitting micro-batches. When
    the count already exceeds the largest such multiple ≤ the sample count, start again from
    whole-domain micro-batches (first-fit decreasing), or raise when even those are too many."""
    if not vpp or len(drafts) % vpp == 0:
        return drafts
    limit = len(items) - len(items) % vpp
    if len(drafts) > limit:
        drafts = whole_domain_microbatches(ctx, items, vpp, limit)
    while len(drafts) % vpp:
        split_microbatch(ctx, drafts)
    return drafts


def whole_domain_microbatches(
    ctx: Context, items: Sequence[Item], vpp: int, limit: int
) -> List[MicroBatchDraft]:
    """Whole-domain micro-batches packed first-fit decreasing by length; ValueError (naming the
    VPP flag) when more than ``limit`` are needed."""
    capacity = ctx.domain.size * ctx.domain.budget
    bins: List[List[Item]] = []
    room: List[int] = []
    for item in longest_first(list(items)):
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


def split_microbatch(ctx: Context, drafts: List[MicroBatchDraft]) -> None:
    """Replace one micro-batch (≥ 2 samples) by two: of the micro-batch with the most samples and
    the lightest one, each split in place (:func:`split_in_place`) or into halves of equal work
    laid out afresh (:func:`split_halves`), the split that adds the least to the critical path."""
    splittable = [i for i, draft in enumerate(drafts) if sum(len(g.items) for g in draft) >= 2]
    assert splittable, "a VPP split needs a micro-batch with two samples"
    fullest = max(splittable, key=lambda i: (sum(len(g.items) for g in drafts[i]), -i))
    lightest = min(splittable, key=lambda i: (peak(drafts[i]), i))
    options = [
        (index, halves)
        for index in dict.fromkeys((fullest, lightest))
        for halves in (split_in_place(ctx, drafts[index]), split_halves(ctx, drafts[index]))
        if halves is not None
    ]
    index, halves = min(options, key=lambda o: (split_growth(drafts[o[0]], o[1]), o[0]))
    drafts[index : index + 1] = halves


def split_in_place(ctx: Context, draft: MicroBatchDraft) -> Optional[List[MicroBatchDraft]]:
    """``draft`` as two micro-batches over its own blocks: the samples of each group holding
    several are dealt to the two halves (heaviest first, to the lighter side); a group of one
    sample goes whole to the half whose such groups weigh less, leaving its block free in the
    other, where :func:`fill_empty_ranks` fills it. None when a half would be left without a
    group (the micro-batch is one group of one non-empty sample)."""
    halves: Tuple[MicroBatchDraft, MicroBatchDraft] = ([], [])
    holes: Tuple[List[Block], List[Block]] = ([], [])
    whole = [0.0, 0.0]
    for group in sorted(draft, key=lambda g: (-g.load, g.block.start)):
        parts = halved(ctx, group)
        if parts is None:
            side = 0 if whole[0] <= whole[1] else 1
            whole[side] += group.load
            whole_group, empty = group_of_items(group.block, group.items, ctx.cost), None
            parts = (whole_group, empty) if side == 0 else (empty, whole_group)
        for side, part in enumerate(parts):
            if part is not None and part.items:
                halves[side].append(part)
            else:
                holes[side].append(group.block)
    if not all(halves):
        return None  # a single group of one sample: no split in place
    for groups, blocks in zip(halves, holes):
        free = BuddyAllocator(ctx.domain)
        free.free = blocks
        fill_empty_ranks(ctx, groups, free)
        rebalance_microbatch(ctx, groups)
    return list(halves)


def halved(ctx: Context, group: GroupDraft) -> Optional[Tuple[GroupDraft, GroupDraft]]:
    """The samples of ``group`` dealt (:func:`~.moves.transfer.deal`) to two groups over its
    block, near-equal in load; None with fewer than two non-empty samples."""
    if sum(1 for item in group.items if item.seqlen > 0) < 2:
        return None
    parts = (ctx.group(group.block), ctx.group(group.block))
    deal(ctx, group.items, parts)
    return parts


def split_halves(ctx: Context, draft: MicroBatchDraft) -> List[MicroBatchDraft]:
    """The samples of ``draft`` in two halves of equal work, each laid out as one micro-batch."""
    items = [item for group in draft for item in group.items]
    capacity = ctx.domain.size * ctx.domain.budget
    halves = lpt_partition(items, 2, capacity, ctx.min_work)
    assert halves is not None and all(halves)
    return [single_microbatch(ctx, heaviest_first(ctx, half)) for half in halves]


def split_growth(draft: MicroBatchDraft, halves: Sequence[MicroBatchDraft]) -> float:
    """How much replacing ``draft`` by ``halves`` adds to Σ peaks."""
    return sum(map(peak, halves)) - peak(draft)


def single_microbatch(ctx: Context, items: List[Item]) -> MicroBatchDraft:
    """``items`` as one micro-batch: laid out by :func:`form_microbatch` when everything fits,
    else one whole-domain group (their tokens fit the domain)."""
    draft, leftovers = form_microbatch(ctx, items)
    return draft if not leftovers else [group_of_items(ctx.domain.root(), items, ctx.cost)]
