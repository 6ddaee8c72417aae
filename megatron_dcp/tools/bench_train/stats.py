"""Paired statistics of step times: medians and speedups with bootstrap intervals, the model's
error against the clock, and how often it orders two plans as the clock does.

Step times vary several-fold between global batches, so arms are compared batch by batch: a
speedup is Σ static / Σ arm over the same batches, and its interval resamples whole batches
(both arms' times of a batch stay together). Pure Python, seeded: the same times give the same
intervals.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

RESAMPLES = 2000
LEVEL = 0.95
# Predicted gaps at least this large are "clear" when scoring the model's ordering of plans.
CLEAR_GAP = 0.10


@dataclass(frozen=True)
class Interval:
    """A statistic and its bootstrap interval (``low`` ≤ ``value`` ≤ ``high`` in practice)."""

    value: float
    low: float
    high: float

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high


def bootstrap(
    statistic: Callable[[Sequence[int]], float], count: int, seed: int = 0
) -> Tuple[float, float]:
    """The central :data:`LEVEL` interval of ``statistic`` over :data:`RESAMPLES` resamples of
    the indices ``0 .. count - 1`` with replacement."""
    rng = random.Random(seed)
    values = sorted(
        statistic([rng.randrange(count) for _ in range(count)]) for _ in range(RESAMPLES)
    )
    tail = (1.0 - LEVEL) / 2
    return values[int(tail * RESAMPLES)], values[int((1.0 - tail) * RESAMPLES) - 1]


def median_interval(times: Sequence[float]) -> Interval:
    """The median of ``times`` with its bootstrap interval."""
    if not times:
        raise ValueError("no step times to summarise (every iteration was a warm-up?)")
    low, high = bootstrap(lambda idx: statistics.median(times[i] for i in idx), len(times))
    return Interval(statistics.median(times), low, high)


def speedup_interval(base: Sequence[float], other: Sequence[float]) -> Interval:
    """Σ ``base`` / Σ ``other`` (``other`` faster when > 1) over paired batches, with the
    interval of resampled batches."""
    if len(base) != len(other) or not base:
        raise ValueError(f"paired times needed: {len(base)} and {len(other)} batches")

    def ratio(idx: Sequence[int]) -> float:
        return sum(base[i] for i in idx) / sum(other[i] for i in idx)

    low, high = bootstrap(ratio, len(base))
    return Interval(sum(base) / sum(other), low, high)


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> List[float]:
    """|predicted − measured| / measured, pairwise."""
    return [abs(p - m) / m for p, m in zip(predicted, measured) if m > 0]


@dataclass(frozen=True)
class Ordering:
    """How often the model orders two plans of one batch as the clock does."""

    clear_agree: int
    clear_total: int
    close_agree: int
    close_total: int


def ordering(pairs: Sequence[Tuple[float, float, float, float]]) -> Ordering:
    """``pairs`` of (predicted a, predicted b, measured a, measured b); a pair agrees when both
    say the same plan is faster. Pairs whose predictions differ by ≥ :data:`CLEAR_GAP` of the
    faster one count as clear, the rest as close."""
    counts = [0, 0, 0, 0]
    for pa, pb, ma, mb in pairs:
        clear = abs(pa - pb) >= CLEAR_GAP * min(pa, pb)
        agree = (pa < pb) == (ma < mb)
        base = 0 if clear else 2
        counts[base] += agree
        counts[base + 1] += 1
    return Ordering(*counts)
