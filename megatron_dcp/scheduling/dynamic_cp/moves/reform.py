"""Across the plan: **re-form a pair**, micro-batches formed again two at a time (``reform_pairs``).

The other moves change one or a few samples at a time. What they cannot reach is another grouping of
many samples at once: the critical path is Σ of the micro-batches' peaks, so the heaviest samples of
two micro-batches are best together in one (levelling each other) and the light ones together in the
other, while construction, balancing each micro-batch, tends to mix them. This move pools the
samples of two micro-batches and forms them again the way construction forms a heavy micro-batch:
``form_microbatch`` on the pool, heaviest first, then on what it left. When that pair's Σ peaks is
within ``knobs.promising`` of the old pair's, both are polished (``microbatch_search``), and the
pair replaces the old one if its Σ peaks is lower by at least ``knobs.min_gain`` of the larger peak.
The micro-batch count (so VPP alignment) is unchanged, and each new micro-batch keeps every plan
invariant, as any micro-batch ``form_microbatch`` forms does.

Pairs are tried from the ``knobs.reform_sources`` most imbalanced micro-batches (peak far above
their mean per-rank load), each with every other micro-batch, most loaded first; a pair tried in
vain is not tried again unless one of its micro-batches changed; at most ``knobs.reform_attempts`` ×
the micro-batch count trials in all, on plans of at most ``knobs.search_microbatches``
micro-batches. A trial costs two formings of the pair's samples.
"""

from __future__ import annotations

from typing import List, Optional, Set, Tuple

from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import form_microbatch, heaviest_first
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import polish_microbatch
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    min_plan_gain,
    peak,
)


def reform_pairs(ctx: Context, drafts: List[MicroBatchDraft]) -> None:
    """Re-form pairs of the plan ``drafts`` (in place); see the module docstring. Plans of more than
    ``knobs.search_microbatches`` micro-batches are left as they are."""
    if len(drafts) > ctx.knobs.search_microbatches:
        return
    budget = ctx.knobs.reform_attempts * len(drafts)
    tags = list(range(len(drafts)))  # a new tag for each micro-batch formed again
    failed: Set[Tuple[int, int]] = set()  # pairs of tags tried in vain
    while budget > 0:
        for first, second in candidate_pairs(ctx, drafts):
            key = (tags[first], tags[second])
            if key in failed:
                continue
            if budget <= 0:
                return
            budget -= 1
            pair = reformed(ctx, drafts[first], drafts[second])
            if pair is not None:
                drafts[first], drafts[second] = pair
                tags[first], tags[second] = max(tags) + 1, max(tags) + 2
                break
            failed.add(key)
        else:
            return


def candidate_pairs(ctx: Context, drafts: List[MicroBatchDraft]) -> List[Tuple[int, int]]:
    """(index, index) pairs in trial order: each of the ``knobs.reform_sources`` most imbalanced
    micro-batches with every other, most loaded first."""
    ranks = ctx.domain.size
    spread = [peak(draft) - sum(g.load * g.size for g in draft) / ranks for draft in drafts]
    sources = sorted(range(len(drafts)), key=lambda i: (-spread[i], i))[: ctx.knobs.reform_sources]
    partners = sorted(range(len(drafts)), key=lambda i: (-peak(drafts[i]), i))
    return [(i, j) for i in sources for j in partners if j != i]


def reformed(
    ctx: Context, first: MicroBatchDraft, second: MicroBatchDraft
) -> Optional[List[MicroBatchDraft]]:
    """The samples of ``first`` and ``second`` formed again as two polished micro-batches whose Σ
    peaks is lower by at least ``knobs.min_gain`` of the larger old peak; None when there is no such
    pair (or the samples fit one micro-batch, which would change the count)."""
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
    if peak(opened) + peak(closed) < before - min_plan_gain(ctx, peak(first), peak(second)):
        return [opened, closed]
    return None
