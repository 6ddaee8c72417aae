"""The search across the micro-batches of a plan: moves that change two or more micro-batches
(relocate and swap samples, re-form a pair, swap two CP blocks), driven in two rounds.

One acceptance rule for the moves of this scope: Σ peaks (with the fixed micro-batch cost, the
critical path) must fall by more than ``knobs.min_gain`` of the larger peak the move touches.
A tie-break, on the chosen plan, is the one exception: it keeps every peak and lowers a tied
top group, so that the next move can lower the micro-batch's peak.

The micro-batch count never changes here (VPP alignment holds). The search runs on batches of
at most ``knobs.search_samples`` samples and plans of at most ``knobs.search_microbatches``
micro-batches, bounded by counted passes, steps and trials.
"""

from __future__ import annotations

from typing import List, Sequence

from megatron_dcp.scheduling.dynamic_cp.microbatch_search import polish_plan
from megatron_dcp.scheduling.dynamic_cp.moves.block_swap import swap_blocks
from megatron_dcp.scheduling.dynamic_cp.moves.reform import reform_pairs
from megatron_dcp.scheduling.dynamic_cp.moves.resize import copy_group
from megatron_dcp.scheduling.dynamic_cp.moves.relocate import exchange_between_microbatches
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    draft_critical_path,
)


def search_candidates(ctx: Context, plans: Sequence[List[MicroBatchDraft]], samples: int) -> None:
    """Relocate and swap samples between the micro-batches of every candidate plan (batches of
    at most ``knobs.search_samples`` samples)."""
    if samples <= ctx.knobs.search_samples:
        for drafts in plans:
            exchange_between_microbatches(ctx, drafts)


def search_chosen(ctx: Context, drafts: List[MicroBatchDraft], samples: int, bound: float) -> None:
    """On the chosen plan (batches of at most ``knobs.search_samples`` samples): polish each
    micro-batch, re-form pairs of micro-batches unless the plan is within ``knobs.good_plan`` of
    the lower ``bound``, swap CP blocks, then relocate and swap again, breaking ties. The block
    swaps are made on a copy, kept only when it ends shorter: the final relocate is greedy, and
    from the swapped plan it can end longer than from the plan without them."""
    if samples > ctx.knobs.search_samples:
        return
    polish_plan(ctx, drafts)
    if draft_critical_path(ctx, drafts) > ctx.knobs.good_plan * bound:
        reform_pairs(ctx, drafts)
    relocate_with_block_swaps(ctx, drafts)


def relocate_with_block_swaps(ctx: Context, drafts: List[MicroBatchDraft]) -> None:
    """Relocate and swap samples, breaking ties, on ``drafts`` and on a copy whose CP blocks were
    swapped first; the copy replaces ``drafts`` when it ends shorter."""
    swapped = [[copy_group(g) for g in draft] for draft in drafts]
    swap_blocks(ctx, swapped)
    exchange_between_microbatches(ctx, drafts, ties=True)
    exchange_between_microbatches(ctx, swapped, ties=True)
    if draft_critical_path(ctx, swapped) < draft_critical_path(ctx, drafts):
        drafts[:] = swapped
