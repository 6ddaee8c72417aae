"""Step 9 of ``default_dynamic_cp``: ``reform_pairs``, micro-batches formed again two at a time.

Steps 7 and 8 move one or a few samples at a time. What they cannot reach is another grouping of
many samples at once: the critical path is Σ of the micro-batches' peaks, so the heaviest
samples of two micro-batches are best together in one (levelling each other) and the light ones
together in the other, while the earlier steps, balancing each micro-batch, tend to mix them.
This step pools the samples of two micro-batches and forms them again the way step 2 forms a
heavy micro-batch: ``next_hdp_group`` on the pool, heaviest first, then on what it left. When
that pair's Σ peaks is within ``PROMISING`` of the old pair's, step 8 polishes both, and the
pair replaces the old one if its Σ peaks is lower by at least ``MIN_GAIN`` of the larger peak.
The micro-batch count (so VPP alignment) is unchanged, and each new micro-batch keeps every
plan invariant, as any micro-batch step 3 forms does.

Pairs are tried from the ``SOURCES`` most imbalanced micro-batches (peak far above their mean
per-rank load), each with every other micro-batch, most loaded first; a pair tried in vain is not
tried again unless one of its micro-batches changed; at most ``ATTEMPTS`` × the micro-batch count
trials in all, on plans of at most ``REFORM_ROWS`` micro-batches. A trial costs two formings of
the pair's samples.
"""

from __future__ import annotations

from typing import List, Optional, Set, Tuple

from megatron_dcp.scheduling.dynamic_cp_context import Context, Row, peak
from megatron_dcp.scheduling.microbatch_forming import heaviest_first, next_hdp_group
from megatron_dcp.scheduling.row_polish import polish_row

SOURCES = 12
ATTEMPTS = 6
REFORM_ROWS = 32
PROMISING = 1.02
MIN_GAIN = 1e-4


def reform_pairs(ctx: Context, rows: List[Row]) -> None:
    """Step 9 on the plan ``rows`` (in place); see the module docstring. Plans of more than
    ``REFORM_ROWS`` micro-batches are left as they are."""
    if len(rows) > REFORM_ROWS:
        return
    budget = ATTEMPTS * len(rows)
    tags = list(range(len(rows)))  # a new tag for each micro-batch formed again
    failed: Set[Tuple[int, int]] = set()  # pairs of tags tried in vain
    while budget > 0:
        for first, second in candidate_pairs(ctx, rows):
            key = (tags[first], tags[second])
            if key in failed:
                continue
            if budget <= 0:
                return
            budget -= 1
            pair = reformed(ctx, rows[first], rows[second])
            if pair is not None:
                rows[first], rows[second] = pair
                tags[first], tags[second] = max(tags) + 1, max(tags) + 2
                break
            failed.add(key)
        else:
            return


def candidate_pairs(ctx: Context, rows: List[Row]) -> List[Tuple[int, int]]:
    """(index, index) pairs in trial order: each of the ``SOURCES`` most imbalanced micro-batches
    with every other, most loaded first."""
    ranks = ctx.domain.size
    spread = [peak(row) - sum(g.load * g.size for g in row) / ranks for row in rows]
    sources = sorted(range(len(rows)), key=lambda i: (-spread[i], i))[:SOURCES]
    partners = sorted(range(len(rows)), key=lambda i: (-peak(rows[i]), i))
    return [(i, j) for i in sources for j in partners if j != i]


def reformed(ctx: Context, first: Row, second: Row) -> Optional[List[Row]]:
    """The samples of ``first`` and ``second`` formed again as two polished micro-batches whose
    Σ peaks is lower by at least ``MIN_GAIN`` of the larger old peak; None when there is no such
    pair (or the samples fit one micro-batch, which would change the count)."""
    pool = heaviest_first(ctx, [item for group in first + second for item in group.items])
    opened, rest = next_hdp_group(ctx, pool)
    if not rest:
        return None
    closed, left = next_hdp_group(ctx, heaviest_first(ctx, rest))
    before = peak(first) + peak(second)
    if left or peak(opened) + peak(closed) > PROMISING * before:
        return None
    polish_row(ctx, opened)
    polish_row(ctx, closed)
    if peak(opened) + peak(closed) < before - MIN_GAIN * max(peak(first), peak(second)):
        return [opened, closed]
    return None
