"""The search across the micro-batches of a plan: one driver (:func:`improve_plan`) and the moves
that change two or more micro-batches as its units (relocate and swap, tie-break, re-form a pair,
swap two CP blocks, swap two tiled blocks; ``moves/``), run in two rounds
(:func:`search_candidates`, :func:`search_chosen`).

A move (:class:`PlanMove`) finds, for one micro-batch, its best candidate and what it gains
(a :class:`~.moves.transfer.PlanCandidate`) and changes nothing; the driver decides and applies.
One acceptance rule for the moves of this scope: Σ peaks (with the fixed micro-batch cost, the
critical path) must fall by more than ``knobs.min_gain`` of the larger peak the move weighs
(:func:`~.search_state.min_plan_gain`). A tie-break, on the chosen plan, is the one exception: it
keeps every peak and lowers a tied top group by that much, so that the next move can lower the
micro-batch's peak.

The micro-batch count never changes here (VPP alignment holds). The search runs on batches of
at most ``knobs.search_samples`` samples (up to ``knobs.polish_samples``: the polish of
imbalanced micro-batches only) and (sample moves) plans of at most ``knobs.search_microbatches``
micro-batches, bounded by counted passes, steps and trials, never by time: every rank computes
the same plan.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence

from megatron_dcp.scheduling.dynamic_cp.microbatch_search import polish_imbalanced, polish_plan
from megatron_dcp.scheduling.dynamic_cp.moves.block_swap import BlockSwap
from megatron_dcp.scheduling.dynamic_cp.moves.reform import ReformPair
from megatron_dcp.scheduling.dynamic_cp.moves.relocate import Relocate, TieBreak
from megatron_dcp.scheduling.dynamic_cp.moves.resize import copy_group
from megatron_dcp.scheduling.dynamic_cp.moves.tile_swap import TileSwap
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import PlanCandidate
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    draft_critical_path,
    min_plan_gain,
    peak,
)


class PlanMove(Protocol):
    """A move across the plan as the driver sees it, made for one plan (and holding what it
    memoises about it): the driver makes at most ``passes`` passes over the micro-batches in
    ``order()``, at most ``steps`` moves at each; with ``restart``, a pass ends at its first move
    (the move's order then follows the plan it changed)."""

    passes: int
    steps: int
    restart: bool

    def order(self) -> List[int]:
        """The micro-batches one pass visits, in order."""

    def find(self, index: int) -> Optional[PlanCandidate]:
        """Micro-batch ``index``'s best candidate; None when it has none."""


# Makes the move for a plan: the move classes themselves.
MakeMove = Callable[[Context, List[MicroBatchDraft]], PlanMove]


def improve_plan(ctx: Context, drafts: List[MicroBatchDraft], make_move: MakeMove) -> None:
    """Passes over the micro-batches of ``drafts`` in the move's order, each applying the move
    at a micro-batch while one is accepted (at most ``steps`` there); the search ends after a
    pass that did not lower Σ peaks (one that only broke ties) or after ``passes`` passes."""
    move = make_move(ctx, drafts)
    for _ in range(move.passes):
        before = sum(map(peak, drafts))
        for index in move.order():
            if improve_at(ctx, move, index) and move.restart:
                break
        if sum(map(peak, drafts)) >= before:
            return


def improve_at(ctx: Context, move: PlanMove, index: int) -> bool:
    """At most ``move.steps`` accepted moves at micro-batch ``index``: each the move's best
    candidate there, made when its gain exceeds :func:`~.search_state.min_plan_gain` of the
    peaks it weighs. True when one was made."""
    made = False
    for _ in range(move.steps):
        candidate = move.find(index)
        if candidate is None or candidate.gain <= min_plan_gain(ctx, *candidate.peaks):
            break
        candidate.apply()
        made = True
    return made


def search_candidates(ctx: Context, plans: Sequence[List[MicroBatchDraft]], samples: int) -> None:
    """Relocate and swap samples between the micro-batches of every candidate plan (batches of
    at most ``knobs.search_samples`` samples)."""
    if samples <= ctx.knobs.search_samples:
        for drafts in plans:
            improve_plan(ctx, drafts, Relocate)


def search_chosen(ctx: Context, drafts: List[MicroBatchDraft], samples: int, bound: float) -> None:
    """On the chosen plan (batches of at most ``knobs.search_samples`` samples): polish each
    micro-batch, re-form pairs of micro-batches unless the plan is within ``knobs.good_plan`` of
    the lower ``bound``, swap CP blocks, then relocate and swap again, breaking ties; last, rounds
    of tiled-block swaps (:func:`swap_tiles`, until one is not kept). Batches of up to
    ``knobs.polish_samples`` samples get the polish of their imbalanced micro-batches only
    (:func:`~.microbatch_search.polish_imbalanced`)."""
    if samples > ctx.knobs.search_samples:
        if samples <= ctx.knobs.polish_samples:
            polish_imbalanced(ctx, drafts)
        return
    polish_plan(ctx, drafts)
    if draft_critical_path(ctx, drafts) > ctx.knobs.good_plan * bound:
        improve_plan(ctx, drafts, ReformPair)
    relocate_with_block_swaps(ctx, drafts)
    for _ in range(ctx.knobs.tile_rounds):
        if not swap_tiles(ctx, drafts):
            break


def relocate_with_block_swaps(ctx: Context, drafts: List[MicroBatchDraft]) -> None:
    """Relocate and swap samples, breaking ties, on ``drafts`` and on a copy whose CP blocks were
    swapped first; the copy replaces ``drafts`` when it ends shorter: the final relocate is
    greedy, and from the swapped plan it can end longer than from the plan without the swaps."""
    swapped = [[copy_group(g) for g in draft] for draft in drafts]
    improve_plan(ctx, swapped, BlockSwap)
    improve_plan(ctx, drafts, TieBreak)
    improve_plan(ctx, swapped, TieBreak)
    if draft_critical_path(ctx, swapped) < draft_critical_path(ctx, drafts):
        drafts[:] = swapped


def swap_tiles(ctx: Context, drafts: List[MicroBatchDraft]) -> bool:
    """On a copy of the searched plan, swap tiled blocks (:class:`~.moves.tile_swap.TileSwap`),
    then relocate and swap again, breaking ties; the copy replaces ``drafts`` when it ends
    shorter (True then). False when no swap was made or the copy did not end shorter: a copy
    keeps the move from lengthening the plan, as the final relocate is greedy."""
    tiled = [[copy_group(g) for g in draft] for draft in drafts]
    before = sum(map(peak, tiled))
    improve_plan(ctx, tiled, TileSwap)
    if sum(map(peak, tiled)) >= before:
        return False
    improve_plan(ctx, tiled, TieBreak)
    if draft_critical_path(ctx, tiled) < draft_critical_path(ctx, drafts):
        drafts[:] = tiled
        return True
    return False
