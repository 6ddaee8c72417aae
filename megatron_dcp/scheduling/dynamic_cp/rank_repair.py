"""Empty-rank repair: no rank of a micro-batch may be idle (a plan invariant). A free block
takes a sample from a group holding several, or a spare sample; else the groups grow into the
free ranks (power-of-two domains, :func:`grow_groups`) or merge into the parent block. Also the
layout of groups on aligned blocks, largest first (:func:`layout`), which resizing moves use."""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_dcp.scheduling.buddy import BuddyAllocator, contains, parent_block
from megatron_dcp.scheduling.domain import Block, is_power_of_two
from megatron_dcp.scheduling.draft import GroupDraft, Item
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft


def fill_empty_ranks(
    ctx: Context, groups: MicroBatchDraft, free: BuddyAllocator, spare: Optional[List[Item]] = None
) -> None:
    """No rank may be idle. Each free block (smallest first) takes the sample whose move
    from a group holding several leaves the lowest load, else the lightest fitting sample of
    ``spare`` (removed from it); when neither exists, the groups grow into the free ranks
    (:func:`grow_groups`, power-of-two domains) or the block and its neighbouring groups merge
    into one group over the parent block."""
    while free.free:
        block = min(free.free, key=lambda b: (b.size, b.start))
        free.free.remove(block)
        item = take_donor(ctx, groups, block) or take_spare(ctx, spare or [], block)
        if item is not None:
            group = ctx.group(block)
            group.push(item, ctx.load(item.key, block.size))
            groups.append(group)
        elif is_power_of_two(ctx.domain.size):
            free.free.clear()
            grow_groups(ctx, groups)
        else:
            merge_into_parent(ctx, groups, free, block)


def grow_groups(ctx: Context, groups: MicroBatchDraft) -> None:
    """Fill the free ranks of a power-of-two domain by doubling groups, each time the one whose
    doubling leaves the lowest peak (ties: the least added total cost), then lay the groups out
    again on aligned blocks, largest first (positions do not change costs). A free rank count
    is always a multiple of the smallest group size, so the doubling ends with no rank free.
    Each doubling costs O(G) for G groups: only the doubled group's loads are recomputed."""
    free = ctx.domain.size - sum(group.size for group in groups)
    sizes = [group.size for group in groups]
    loads = [group.load for group in groups]
    doubled = [doubled_load(ctx, group, size) for group, size in zip(groups, sizes)]
    while free > 0:
        top = max(range(len(groups)), key=loads.__getitem__)
        second = max((load for i, load in enumerate(loads) if i != top), default=0.0)
        best = min(
            (i for i in range(len(groups)) if sizes[i] <= free),
            key=lambda i: (
                max(second if i == top else loads[top], doubled[i]),
                doubled[i] * 2 * sizes[i] - loads[i] * sizes[i],
                groups[i].block.start,
            ),
        )
        free -= sizes[best]
        sizes[best] *= 2
        loads[best] = doubled[best]
        doubled[best] = doubled_load(ctx, groups[best], sizes[best])
    layout(ctx, groups, dict(zip(map(id, groups), sizes)))


def layout(ctx: Context, groups: MicroBatchDraft, sizes: dict) -> None:
    """Replace ``groups`` by groups of the given ``sizes`` over consecutive aligned blocks,
    largest first (sizes are powers of two, so each block starts at a multiple of its size)."""
    start, laid = 0, []
    for group in sorted(groups, key=lambda g: (-sizes[id(g)], g.block.start)):
        size = sizes[id(group)]
        grown = ctx.group(Block(start, size))
        for item in group.items:
            grown.push(item, ctx.load(item.key, size))
        laid.append(grown)
        start += size
    groups[:] = laid


def doubled_load(ctx: Context, group: GroupDraft, size: int) -> float:
    """Load of ``group``'s samples on twice ``size`` ranks (infinite past the domain)."""
    return grown_load(ctx, group, 2 * size) if 2 * size <= ctx.domain.size else float("inf")


def grown_load(ctx: Context, group: GroupDraft, size: int) -> float:
    """Load of ``group``'s samples on ``size`` ranks (ring steps included)."""
    return sum(ctx.load(item.key, size) for item in group.items) + ctx.rings[size]


def take_spare(ctx: Context, spare: List[Item], block: Block) -> Optional[Item]:
    """Remove and return the last (lightest, for a heaviest-first list) sample of ``spare`` that
    fits ``block``; None when none does."""
    for index in range(len(spare) - 1, -1, -1):
        item = spare[index]
        if item.min_cp <= block.size and 0 < item.seqlen <= block.size * ctx.domain.budget:
            return spare.pop(index)
    return None


def take_donor(ctx: Context, groups: MicroBatchDraft, block: Block) -> Optional[Item]:
    """Remove and return the sample whose move into ``block`` leaves the smallest maximum of the
    two loads, among groups holding several samples; None when no group can spare one."""
    best: Optional[Tuple[Tuple[float, int, int], GroupDraft, Item]] = None
    for group in groups:
        if len(group.items) < 2:
            continue
        for item in group.items:
            if not 0 < item.seqlen <= block.size * ctx.domain.budget or item.min_cp > block.size:
                continue  # an empty sample would leave the block without work
            if group.tokens == item.seqlen:
                continue  # nor may the group be left with empty samples only
            remaining = group.load - ctx.load(item.key, group.size)
            peak = max(remaining, ctx.alone(item.key, block.size))
            key = (peak, group.block.start, item.sample_id)
            if best is None or key < best[0]:
                best = (key, group, item)
    if best is None:
        return None
    _, group, item = best
    group.pop(item, ctx.load(item.key, group.size))
    return item


def merge_into_parent(
    ctx: Context, groups: MicroBatchDraft, free: BuddyAllocator, block: Block
) -> None:
    """Replace ``block``'s parent subtree (groups and free blocks) by one group over the parent,
    or by one free block when the subtree holds no group (buddies freed separately)."""
    parent = parent_block(ctx.domain, block)
    inside = sorted((g for g in groups if contains(parent, g.block)), key=lambda g: g.block.start)
    free.free = [b for b in free.free if not contains(parent, b)]
    if not inside:
        free.free.append(parent)
        return
    merged = ctx.group(parent)
    for group in inside:
        groups.remove(group)
        for item in group.items:
            merged.push(item, ctx.load(item.key, parent.size))
    groups.append(merged)
