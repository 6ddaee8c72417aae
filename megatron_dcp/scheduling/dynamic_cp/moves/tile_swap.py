"""Across the plan: **swap two tiled blocks**, the groups tiling an aligned block of S ranks
around a micro-batch's top group traded for the groups tiling an aligned block of S ranks in
another micro-batch (:class:`TileSwap`, a move of the plan driver ``plan_search.improve_plan``).

Swapping two CP blocks (``block_swap``) trades the samples of two groups of one size. The blocks
of a micro-batch are tiled differently, though: one micro-batch runs a block of 4 ranks as one
group, another as four groups of 1. A group's load depends on its size only and an aligned block
lays out the same anywhere, so the groups tiling an aligned block of S ranks can move, as they
are, to any aligned block of S ranks that another micro-batch tiles (its groups inside it): the
first micro-batch's peak falls to the larger of its groups outside the block and the incoming
block's, the other's rises at most to the outgoing block's peak (its top group's load). S runs
from the top group's size up to half the domain (a whole-domain block would trade micro-batches).
"""

from __future__ import annotations

from bisect import bisect_right
from functools import partial
from itertools import accumulate
from typing import Dict, List, Optional, Tuple

from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import GroupDraft
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import PlanCandidate
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    min_plan_gain,
    most_loaded_first,
    peak,
)


class TileSwap:
    """Tiled-block swaps as a move of the plan driver: at micro-batch ``index``, the swap that
    lowers Σ peaks the most; one per micro-batch and pass, the micro-batches most-loaded first, at
    most ``knobs.exchange_passes`` passes (a find costs O(K · (G + N/S)) per block size S for K
    micro-batches of G groups over N ranks)."""

    steps = 1
    restart = False

    def __init__(self, ctx: Context, drafts: List[MicroBatchDraft]) -> None:
        self.ctx, self.drafts = ctx, drafts
        self.passes = ctx.knobs.exchange_passes
        self.blocks: Dict[Tuple[int, int], Tiling] = {}

    def tiled(self, index: int, size: int) -> "Tiling":
        """The :class:`Tiling` of micro-batch ``index`` by blocks of ``size`` ranks (memoised
        until a swap changes the micro-batch)."""
        found = self.blocks.get((index, size))
        if found is None:
            draft = self.drafts[index]
            found = self.blocks[(index, size)] = Tiling(draft, size, self.ctx.domain.size)
        return found

    def order(self) -> List[int]:
        """Most-loaded first."""
        return most_loaded_first(self.drafts)

    def find(self, index: int) -> Optional[PlanCandidate]:
        """The trade of a block around micro-batch ``index``'s top group for a tiled block of
        its size elsewhere that lowers Σ peaks the most, by more than
        :func:`~.search_state.min_plan_gain` of the two peaks; None if none does."""
        drafts, ctx = self.drafts, self.ctx
        draft = drafts[index]
        top = max(draft, key=lambda g: (g.load, g.block.start))
        # (gain, the other micro-batch, the two blocks' starts, their size, its peak)
        best: Optional[Tuple[float, int, int, int, int, float]] = None
        size, peaks = top.size, [peak(d) for d in drafts]
        while size <= ctx.domain.size // 2:
            start = top.block.start // size * size
            if start + size > ctx.domain.size:
                break  # the block would pass the last rank (N not a power of two)
            outside = max((g.load for g in draft if not inside(g, start, size)), default=0.0)
            if top.load - outside <= min_plan_gain(ctx, top.load):
                size *= 2
                continue  # the peak stays at ``outside``: no block of this size relieves it
            for other, other_peak in enumerate(peaks):
                if other == index:
                    continue
                floor = min_plan_gain(ctx, top.load, other_peak)
                for there, tile_peak, rest in self.tiled(other, size).options(outside):
                    gain = top.load - max(outside, tile_peak)
                    gain -= max(rest, top.load) - other_peak
                    if gain > floor and (best is None or gain > best[0]):
                        best = (gain, other, start, there, size, other_peak)
            size *= 2
        if best is None:
            return None
        gain, other, start, there, size, other_peak = best
        swap = partial(self.swap, index, start, other, there, size)
        return PlanCandidate(gain, (top.load, other_peak), swap)

    def swap(self, index: int, start: int, other: int, there: int, size: int) -> None:
        """Trade the blocks (:func:`swap_blocks`); forget the two micro-batches' tilings."""
        swap_blocks(self.drafts[index], start, self.drafts[other], there, size)
        self.blocks = {key: v for key, v in self.blocks.items() if key[0] not in (index, other)}


def inside(group: GroupDraft, start: int, size: int) -> bool:
    return start <= group.block.start < start + size


class Tiling:
    """The aligned blocks of ``size`` ranks that a micro-batch's groups tile (no larger group
    spans them) as a swap weighs them: the block holding its top group (``top_start``, its peak
    ``top_load``, the peak of the micro-batch without it ``top_rest``) and the others by rising
    peak (``loads``, the lowest start up to each in ``first_start``), all of which leave the
    micro-batch's peak (``rest``) outside them."""

    def __init__(self, draft: MicroBatchDraft, size: int, ranks: int) -> None:
        blocks: Dict[int, float] = {}
        spanning = 0.0
        for group in draft:
            key = group.block.start // size * size
            if group.size > size or key + size > ranks:
                spanning = max(spanning, group.load)  # no block of ``size`` ranks holds it
            else:
                blocks[key] = max(blocks.get(key, 0.0), group.load)
        ordered = sorted(blocks.items(), key=lambda kv: (kv[1], kv[0]))
        self.top_start, self.top_load = ordered.pop() if ordered else (-1, 0.0)
        self.top_rest = max(ordered[-1][1] if ordered else 0.0, spanning)
        self.rest = max(self.top_load, spanning)
        self.loads = [load for _, load in ordered]
        self.starts = [start for start, _ in ordered]
        self.first_start = list(accumulate(self.starts, min))

    def options(self, outside: float) -> List[Tuple[int, float, float]]:
        """(start, peak of the block's groups, peak of the others) of the blocks a swap against
        a micro-batch whose peak outside the traded block is ``outside`` may prefer, by start:
        the top's block and, of the others, the one leaving the lowest peak (ties: the lowest
        start; its peak counted as ``outside`` where below it)."""
        found = []
        if self.loads:
            below = bisect_right(self.loads, outside)
            if below:
                found.append((self.first_start[below - 1], outside, self.rest))
            else:
                found.append((self.starts[0], self.loads[0], self.rest))
        if self.top_start >= 0:
            found.append((self.top_start, self.top_load, self.top_rest))
        return sorted(found)


def swap_blocks(
    first: MicroBatchDraft, start: int, second: MicroBatchDraft, there: int, size: int
) -> None:
    """The groups of ``first`` in the block of ``size`` ranks at ``start`` and those of
    ``second`` at ``there`` trade places (moved as they are)."""
    leaving = [g for g in first if inside(g, start, size)]
    coming = [g for g in second if inside(g, there, size)]
    for group in leaving:
        first.remove(group)
        group.block = Block(group.block.start - start + there, group.size)
        second.append(group)
    for group in coming:
        second.remove(group)
        group.block = Block(group.block.start - there + start, group.size)
        first.append(group)
