"""Inside a micro-batch: **shift** a sample of the top group to one of the lightest groups, or
trade it there for a shorter sample (a swap), and **rebalance**, the lighter variant the forming
of each micro-batch runs (moves only, fewer partners).

Samples of the top group are examined heaviest first (longest first for text): once the top
would stay above the best found without one, it would without every lighter one too. With vision
work a sample at least as long may be the lighter: a trade takes it back too (``lighter``).
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

from megatron_dcp.scheduling.draft import GroupDraft, Item
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import (
    Candidate,
    heaviest_on,
    lighter,
    lightest,
    spread,
    transfer,
)
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft


def find_shift(ctx: Context, draft: MicroBatchDraft, top: GroupDraft) -> Optional[Candidate]:
    """The shift (a move or a trade) of a sample of ``top`` to one of the
    ``knobs.polish_partners`` lightest groups that leaves the lowest larger load, when both
    loads end below ``top``'s; None when none does."""
    knobs = ctx.knobs
    best: Optional[Tuple[float, Item, GroupDraft, Optional[Item]]] = None
    limit = top.load * (1 - knobs.eps)
    partners = lightest(draft, top, knobs.polish_partners)
    costs = ctx.per_size[top.size]
    for item in spread(heaviest_on(ctx, list(top.items), top.size), knobs.polish_items):
        out = costs[item.key]
        if top.load - out >= limit:
            break
        for group in partners:
            if group.load >= limit:
                break  # heavier partners end above the limit too
            if group.size < item.min_cp:
                continue
            for peak, back in shift_options(ctx, top, item, out, group, limit):
                if peak < limit:
                    best, limit = (peak, item, group, back), peak
    if best is None:
        return None
    peak, item, group, back = best
    return Candidate(peak, partial(transfer, ctx, top, item, group, back))


def shift_options(
    ctx: Context, top: GroupDraft, item: Item, out: float, group: GroupDraft, limit: float
) -> List[Tuple[float, Optional[Item]]]:
    """(larger resulting load, sample traded back or None) of moving ``item`` (per-rank cost
    ``out`` on ``top``) to ``group`` below ``limit``: a move when ``top`` keeps a non-empty
    sample, trades with shorter samples of ``group`` that ``top`` can take."""
    options: List[Tuple[float, Optional[Item]]] = []
    group_costs, top_costs = ctx.per_size[group.size], ctx.per_size[top.size]
    budget, left = ctx.domain.budget, top.tokens - item.seqlen
    grown = group.load + group_costs[item.key]
    room = group.size * budget - group.tokens - item.seqlen
    if left > 0 and room >= 0:
        options.append((max(top.load - out, grown), None))
    top_room = top.size * budget - left
    shed = top.load - out
    for back in spread(group.items, ctx.knobs.trade_items):
        length = back.seqlen
        if room + length < 0 or back.min_cp > top.size or length > top_room or left + length <= 0:
            continue
        if length >= item.seqlen and not (ctx.vision and lighter(ctx, back, item, top.size)):
            continue
        peak = max(shed + top_costs[back.key], grown - group_costs[back.key])
        options.append((peak, back))
    return options


def find_rebalance(ctx: Context, draft: MicroBatchDraft, top: GroupDraft) -> Optional[Candidate]:
    """The move of a sample of ``top`` (at most ``knobs.rebalance_items`` examined, in their
    order) to one of the ``knobs.rebalance_partners`` lightest groups that lowers the larger of
    the two loads most; ``top`` keeps a non-empty sample. None when none lowers it."""
    knobs = ctx.knobs
    if len(top.items) < 2:
        return None
    partners = lightest(draft, top, knobs.rebalance_partners)
    best, best_peak = None, top.load * (1 - knobs.eps)
    for item in spread(top.items, knobs.rebalance_items):
        if top.tokens == item.seqlen:
            continue  # ``top`` would keep empty samples only
        for partner in partners:
            if item.min_cp > partner.size or ctx.room(partner) < item.seqlen:
                continue
            peak = max(
                top.load - ctx.load(item.key, top.size),
                partner.load + ctx.load(item.key, partner.size),
            )
            if peak < best_peak:
                best, best_peak = (item, partner), peak
    if best is None:
        return None
    item, partner = best
    return Candidate(best_peak, partial(transfer, ctx, top, item, partner, None))
