"""Across the plan: **swap two CP blocks**, the samples of a micro-batch's top group traded for
those of a group of the same size in another micro-batch, blocks kept.

A group's load depends on its size only, so the two groups carry their loads across: the first
micro-batch's peak falls to the larger of its other groups and the incoming load, the other's
rises to the outgoing load at most. It pays where a heavy group stands alone at the top of its
micro-batch while another micro-batch already runs as high: two heavy groups then share one
micro-batch's peak, which the sample moves cannot arrange when each group's samples are long.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_dcp.scheduling.draft import GroupDraft
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    min_plan_gain,
    peak,
)

# (gain, top group, the other micro-batch's index, its group)
BlockSwap = Tuple[float, GroupDraft, int, GroupDraft]


def find_block_swap(ctx: Context, drafts: List[MicroBatchDraft], index: int) -> Optional[BlockSwap]:
    """The swap of micro-batch ``index``'s top group with a group of its size elsewhere that
    lowers Σ peaks the most, by more than :func:`~.search_state.min_plan_gain`; None if none."""
    draft = drafts[index]
    ordered = sorted(draft, key=lambda g: (g.load, g.block.start))
    top, second = ordered[-1], (ordered[-2].load if len(ordered) > 1 else 0.0)
    best: Optional[BlockSwap] = None
    for other, partner_draft in enumerate(drafts):
        if other == index:
            continue
        other_peak = peak(partner_draft)
        floor = min_plan_gain(ctx, top.load, other_peak)
        for group in partner_draft:
            if group.size != top.size or group.load >= top.load:
                continue
            rest = max((g.load for g in partner_draft if g is not group), default=0.0)
            gain = top.load - max(second, group.load) - (max(rest, top.load) - other_peak)
            if gain > floor and (best is None or gain > best[0]):
                best = (gain, top, other, group)
    return best


def swap_contents(first: GroupDraft, second: GroupDraft) -> None:
    """Trade the samples (with their loads and tokens) of two groups of one size."""
    first.items, second.items = second.items, first.items
    first.load, second.load = second.load, first.load
    first.tokens, second.tokens = second.tokens, first.tokens


def swap_blocks(ctx: Context, drafts: List[MicroBatchDraft]) -> None:
    """Passes over the micro-batches, most-loaded first, each making its best block swap while
    one pays; at most ``knobs.exchange_passes`` passes."""
    for _ in range(ctx.knobs.exchange_passes):
        swapped = False
        for index in sorted(range(len(drafts)), key=lambda i: (-peak(drafts[i]), i)):
            found = find_block_swap(ctx, drafts, index)
            if found is not None:
                swap_contents(found[1], found[3])
                swapped = True
        if not swapped:
            return
