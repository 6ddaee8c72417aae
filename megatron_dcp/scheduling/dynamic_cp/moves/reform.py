"""Across the plan: **re-form a pair**, micro-batches formed again two at a time (:class:`ReformPair`,
a move of the plan driver ``plan_search.improve_plan``).

The other moves change one or a few samples at a time. What they cannot reach is another grouping of
many samples at once: the critical path is Σ of the micro-batches' peaks, so the heaviest samples of
two micro-batches are best together in one (levelling each other) and the light ones together in the
other, while construction, balancing each micro-batch, tends to mix them. This move pools the
samples of two micro-batches and forms them again the way construction forms a heavy micro-batch:
``form_microbatch`` on the pool, heaviest first, then on what it left. When that pair's Σ peaks is
within ``knobs.promising`` of the old pair's, both are polished (``microbatch_search``), and the
pair replaces the old one if its Σ peaks is lower by more than ``knobs.min_gain`` of the larger peak.
The micro-batch count (so VPP alignment) is unchanged, and each new micro-batch keeps every plan
invariant, as any micro-batch ``form_microbatch`` forms does.

Pairs are tried from the ``knobs.reform_sources`` most imbalanced micro-batches (peak far above
their mean per-rank load), each with every other micro-batch, most loaded first; the first pair
that pays is made, and the trials start again from the most imbalanced (a driver pass ends at
its first move). A pair tried in vain is not tried again unless one of its micro-batches changed;
at most ``knobs.reform_attempts`` × the micro-batch count trials in all, on plans of at most
``knobs.search_microbatches`` micro-batches. A trial costs two formings of the pair's samples.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Set, Tuple

from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import form_microbatch, heaviest_first
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import polish_microbatch
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import PlanCandidate
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    min_plan_gain,
    most_loaded_first,
    peak,
    searchable,
)


class ReformPair:
    """Re-forming pairs as a move of the plan driver: micro-batch ``index`` (one of the most
    imbalanced) re-formed with the first partner, most loaded first, whose pair pays; a pass ends
    at its first move (the order follows the plan). Each pass makes a trial at least, so the
    trial budget bounds the passes too."""

    steps = 1
    restart = True

    def __init__(self, ctx: Context, drafts: List[MicroBatchDraft]) -> None:
        self.ctx, self.drafts = ctx, drafts
        self.trials = ctx.knobs.reform_attempts * len(drafts) if searchable(ctx, drafts) else 0
        self.passes = self.trials
        self.tags = list(range(len(drafts)))  # a new tag for each micro-batch formed again
        self.failed: Set[Tuple[int, int]] = set()  # pairs of tags tried in vain

    def order(self) -> List[int]:
        """The ``knobs.reform_sources`` most imbalanced micro-batches (peak above the mean
        per-rank load), most imbalanced first."""
        ranks = self.ctx.domain.size
        spread = [peak(d) - sum(g.load * g.size for g in d) / ranks for d in self.drafts]
        ordered = sorted(range(len(self.drafts)), key=lambda i: (-spread[i], i))
        return ordered[: self.ctx.knobs.reform_sources]

    def find(self, index: int) -> Optional[PlanCandidate]:
        """The first pair of micro-batch ``index`` and another, most loaded first, not tried in
        vain before, that pays re-formed (:func:`reformed`); None when none does or the trials
        are spent."""
        drafts, tags = self.drafts, self.tags
        for other in most_loaded_first(drafts):
            key = (tags[index], tags[other])
            if other == index or key in self.failed:
                continue
            if self.trials <= 0:
                return None
            self.trials -= 1
            found = reformed(self.ctx, drafts[index], drafts[other])
            if found is not None:
                gain, pair = found
                peaks = (peak(drafts[index]), peak(drafts[other]))
                return PlanCandidate(gain, peaks, partial(self.replace, index, other, pair))
            self.failed.add(key)
        return None

    def replace(self, first: int, second: int, pair: List[MicroBatchDraft]) -> None:
        """Micro-batches ``first`` and ``second`` become ``pair``, with new tags."""
        self.drafts[first], self.drafts[second] = pair
        self.tags[first], self.tags[second] = max(self.tags) + 1, max(self.tags) + 2


def reformed(
    ctx: Context, first: MicroBatchDraft, second: MicroBatchDraft
) -> Optional[Tuple[float, List[MicroBatchDraft]]]:
    """The samples of ``first`` and ``second`` formed again as two polished micro-batches whose Σ
    peaks is lower by more than ``knobs.min_gain`` of the larger old peak, with that fall; None
    when there is no such pair (or the samples fit one micro-batch, which would change the
    count)."""
    pool = heaviest_first(ctx, [item for group in first + second for item in group.items])
    opened, rest = form_microbatch(ctx, pool)
    if not rest:
        return None
    closed, left = form_microbatch(ctx, heaviest_first(ctx, rest))
    before = peak(first) + peak(second)
    if left or peak(opened) + peak(closed) > ctx.knobs.promising * before:
        return None
    polish_microbatch(ctx, opened)
    polish_microbatch(ctx, closed)
    gain = before - (peak(opened) + peak(closed))
    if gain > min_plan_gain(ctx, peak(first), peak(second)):
        return gain, [opened, closed]
    return None
