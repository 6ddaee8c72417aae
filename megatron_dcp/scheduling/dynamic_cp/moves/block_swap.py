"""Across the plan: **swap two CP blocks**, the samples of a micro-batch's top group traded for
those of a group of the same size in another micro-batch, blocks kept (:class:`BlockSwap`, a move
of the plan driver ``plan_search.improve_plan``).

A group's load depends on its size only, so the two groups carry their loads across: the first
micro-batch's peak falls to the larger of its other groups and the incoming load, the other's
rises to the outgoing load at most. It pays where a heavy group stands alone at the top of its
micro-batch while another micro-batch already runs as high: two heavy groups then share one
micro-batch's peak, which the sample moves cannot arrange when each group's samples are long.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional

from megatron_dcp.scheduling.draft import GroupDraft
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import PlanCandidate
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    min_plan_gain,
    most_loaded_first,
    peak,
)


class BlockSwap:
    """Block swaps as a move of the plan driver: at micro-batch ``index``, the swap that lowers Σ
    peaks the most; one per micro-batch and pass, the micro-batches most-loaded first, at most
    ``knobs.exchange_passes`` passes, on plans of any micro-batch count (a find costs at most
    O(K · G²) for K micro-batches of G groups)."""

    steps = 1
    restart = False

    def __init__(self, ctx: Context, drafts: List[MicroBatchDraft]) -> None:
        self.ctx, self.drafts = ctx, drafts
        self.passes = ctx.knobs.exchange_passes

    def order(self) -> List[int]:
        """Most-loaded first."""
        return most_loaded_first(self.drafts)

    def find(self, index: int) -> Optional[PlanCandidate]:
        """The swap of micro-batch ``index``'s top group with a group of its size elsewhere that
        lowers Σ peaks the most, by more than :func:`~.search_state.min_plan_gain` of the two
        peaks; None if none does."""
        drafts, ctx = self.drafts, self.ctx
        ordered = sorted(drafts[index], key=lambda g: (g.load, g.block.start))
        top, second = ordered[-1], (ordered[-2].load if len(ordered) > 1 else 0.0)
        best: Optional[PlanCandidate] = None
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
                if gain > floor and (best is None or gain > best.gain):
                    swap = partial(swap_contents, top, group)
                    best = PlanCandidate(gain, (top.load, other_peak), swap)
        return best


def swap_contents(first: GroupDraft, second: GroupDraft) -> None:
    """Trade the samples (with their loads and tokens) of two groups of one size."""
    first.items, second.items = second.items, first.items
    first.load, second.load = second.load, first.load
    first.tokens, second.tokens = second.tokens, first.tokens
