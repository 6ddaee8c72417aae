"""Inside a micro-batch: **redeal** the samples of the top group and of one of the lightest
groups between their two blocks, longest first to where the load ends least. Several samples
change places at once, which no shift does."""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

from megatron_dcp.scheduling.draft import GroupDraft
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import (
    Candidate,
    deal,
    lightest,
    replace_groups,
)
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft, peak


def find_redeal(ctx: Context, draft: MicroBatchDraft, top: GroupDraft) -> Optional[Candidate]:
    """The redeal of ``top`` with one of the ``knobs.polish_partners`` lightest groups whose
    higher load is least, when both end below ``top``'s; None when none does."""
    best: Optional[Tuple[GroupDraft, MicroBatchDraft]] = None
    limit = top.load * (1 - ctx.knobs.eps)
    for group in lightest(draft, top, ctx.knobs.polish_partners):
        if len(top.items) + len(group.items) < 3:
            continue
        pair = dealt(ctx, top, group)
        if pair is not None and peak(pair) < limit:
            best, limit = (group, pair), peak(pair)
    if best is None:
        return None
    group, pair = best
    return Candidate(limit, partial(replace_groups, draft, (top, group), pair))


def dealt(ctx: Context, top: GroupDraft, group: GroupDraft) -> Optional[MicroBatchDraft]:
    """New groups over the blocks of ``top`` and ``group`` holding their samples, dealt by
    :func:`~.transfer.deal`; None when a sample fits neither or a group would be left without a
    non-empty sample."""
    pair = sorted((ctx.group(top.block), ctx.group(group.block)), key=lambda g: g.block.start)
    if not deal(ctx, top.items + group.items, pair) or any(g.tokens <= 0 for g in pair):
        return None
    return [g for g in pair if g.block is top.block] + [g for g in pair if g.block is not top.block]
