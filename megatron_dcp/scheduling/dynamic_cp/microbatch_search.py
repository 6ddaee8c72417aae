"""The search inside one micro-batch: moves around its *top group* (the most-loaded one, whose
load is the micro-batch's peak) while one lowers it.

One acceptance rule for every move of this scope: every load the move touches ends below the
top's load (by more than ``knobs.eps``). The sorted vector of the micro-batch's loads then falls
with each move, so the search ends; it is bounded by a count of moves besides.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from megatron_dcp.scheduling.domain import is_power_of_two
from megatron_dcp.scheduling.draft import GroupDraft
from megatron_dcp.scheduling.dynamic_cp.moves.redeal import find_redeal
from megatron_dcp.scheduling.dynamic_cp.moves.resize import find_merge, find_split
from megatron_dcp.scheduling.dynamic_cp.moves.shift import find_rebalance, find_shift
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import Candidate
from megatron_dcp.scheduling.dynamic_cp.rank_repair import layout
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft, peak

# Finds a move around the top group of a micro-batch (None when it has none).
Finder = Callable[[Context, MicroBatchDraft, GroupDraft], Optional[Candidate]]

# The polish, tried in this order; the resizing moves only in power-of-two domains.
POLISH: Sequence[Finder] = (find_shift, find_redeal)
RESIZE: Sequence[Finder] = (find_merge, find_split)


def improve_microbatch(
    ctx: Context, draft: MicroBatchDraft, finders: Sequence[Finder], steps: int
) -> bool:
    """At most ``steps`` times, make the first move ``finders`` find (in their order) that the
    acceptance rule admits; returns True when ``draft`` changed (laid out again on aligned
    blocks when group sizes did)."""
    changed = resized = False
    for _ in range(steps):
        top = max(draft, key=lambda g: (g.load, -g.block.start))
        move = first_accepted(ctx, draft, top, finders)
        if move is None:
            break
        move.apply()
        changed, resized = True, resized or move.resizes
    if resized:
        layout(ctx, draft, {id(group): group.size for group in draft})
    return changed


def first_accepted(
    ctx: Context, draft: MicroBatchDraft, top: GroupDraft, finders: Sequence[Finder]
) -> Optional[Candidate]:
    """The first move found that leaves every load it touches below ``top``'s."""
    limit = top.load * (1 - ctx.knobs.eps)
    for find in finders:
        move = find(ctx, draft, top)
        if move is not None and move.peak < limit:
            return move
    return None


def polish_microbatch(ctx: Context, draft: MicroBatchDraft) -> bool:
    """Shift, redeal, then (power-of-two domains) merge and split around the top group, at most
    ``knobs.polish_steps`` moves; returns True when ``draft`` changed."""
    finders = tuple(POLISH) + (tuple(RESIZE) if is_power_of_two(ctx.domain.size) else ())
    return improve_microbatch(ctx, draft, finders, ctx.knobs.polish_steps)


def rebalance_microbatch(ctx: Context, draft: MicroBatchDraft) -> None:
    """The forming's light polish: at most ``knobs.rebalance_steps`` moves of a sample off the
    top group to one of the lightest."""
    improve_microbatch(ctx, draft, (find_rebalance,), ctx.knobs.rebalance_steps)


def polish_plan(ctx: Context, drafts: Sequence[MicroBatchDraft]) -> None:
    """:func:`polish_microbatch` on every micro-batch of a plan."""
    for draft in drafts:
        polish_microbatch(ctx, draft)


def polish_imbalanced(ctx: Context, drafts: Sequence[MicroBatchDraft]) -> None:
    """:func:`polish_microbatch` on the micro-batches whose peak exceeds their mean per-rank
    load by more than ``knobs.polish_imbalance`` of the peak: the polish of batches too large for
    the whole search, spent where a micro-batch is far from balanced."""
    ranks = ctx.domain.size
    for draft in drafts:
        top = peak(draft)
        if top - sum(g.load * g.size for g in draft) / ranks > ctx.knobs.polish_imbalance * top:
            polish_microbatch(ctx, draft)
