"""What a ``bench-train`` run measured, batch by batch and per arm.

Sources: megatron's iteration line (its wall time per iteration, optimizer step included: the
*step time*), the ``[DCP]`` line (the busiest position's forward-backward time, predicted by the
cost model that planned the step and measured) and the run's ``plans.jsonl`` (every arm's plan of
each batch under one cost model). Warm-up batches are dropped before anything is summarised.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_dcp.tools.bench_train.arms import arm_at
from megatron_dcp.tools.bench_train.stats import (
    Interval,
    Ordering,
    median_interval,
    ordering,
    relative_errors,
    speedup_interval,
)
from megatron_dcp.tools.bench_train.worker import PLANS_FILE
from megatron_dcp.tools.launching.training_runs import RunLog

ELAPSED = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
# The model-against-clock windows (training iterations, inclusive).
ERROR_WINDOWS = ((5, 30), (15, 30))


@dataclass(frozen=True)
class Step:
    """One training iteration: an arm running one global batch."""

    iteration: int
    batch: int
    arm: str
    step_ms: float  # megatron's wall time of the iteration
    fwd_bwd_ms: float  # the busiest position's forward-backward busy time
    predicted_ms: float  # its prediction by the cost model that planned the step
    plan: Dict[str, object]  # the arm's figures in plans.jsonl (shared cost model)


@dataclass(frozen=True)
class ArmSummary:
    arm: str
    step_ms: Interval
    speedup: Optional[Interval]  # over static, paired by batch
    tokens_per_s: float
    microbatches: float
    cp_sizes: Dict[int, int]
    plan_time_ms: float
    predicted_ms: float
    fwd_bwd_ms: float
    ratio_to_bound: float  # median critical path / lower bound


@dataclass
class BenchResult:
    arms: Sequence[str]
    steps: List[Step]
    summaries: Dict[str, ArmSummary]
    ordering: Ordering
    errors: Dict[str, float]  # "5-30" -> median |pred − meas| / meas
    dcp_over: Dict[str, Interval]  # DCP's speedup over every other non-static arm, paired
    flags: List[str]
    nproc: int
    oversubscribed: bool
    warmup: int
    unavailable: Dict[str, str] = field(default_factory=dict)
    link: Optional[Dict[str, object]] = None  # --link-rate: request and probed figures


def read_plans(out: Path) -> Dict[int, Dict[str, Dict[str, object]]]:
    records = [json.loads(line) for line in (out / PLANS_FILE).read_text().splitlines() if line]
    return {record["batch"]: record["arms"] for record in records}


def read_steps(log: RunLog, out: Path, arms: Sequence[str]) -> List[Step]:
    elapsed = {int(m.group(1)): float(m.group(2)) for m in ELAPSED.finditer(log.output)}
    plans, steps = read_plans(out), []
    for iteration in sorted(log.dcp):
        batch, arm = arm_at(iteration, arms)
        figures = log.dcp[iteration]
        steps.append(
            Step(
                iteration,
                batch,
                arm,
                elapsed[iteration],
                figures.measured_step_ms,
                figures.predicted_step_ms,
                plans[batch][arm],
            )
        )
    return steps


def collect(
    log: RunLog,
    out: Path,
    arms: Sequence[str],
    warmup: int,
    flags: List[str],
    nproc: int,
    oversubscribed: bool,
) -> BenchResult:
    steps = read_steps(log, out, arms)
    kept = [s for s in steps if s.batch >= warmup]
    by_arm = {arm: sorted((s for s in kept if s.arm == arm), key=lambda s: s.batch) for arm in arms}
    summaries = {arm: summarize(arm, by_arm[arm], by_arm["static"]) for arm in arms}
    dcp_over = {}
    if "dcp" in by_arm:
        dcp_times = [s.step_ms for s in by_arm["dcp"]]
        for arm in arms:
            if arm not in ("static", "dcp"):
                dcp_over[arm] = speedup_interval([s.step_ms for s in by_arm[arm]], dcp_times)
    ordered = plan_ordering(kept, arms)
    return BenchResult(
        arms, steps, summaries, ordered, model_errors(steps), dcp_over, flags, nproc,
        oversubscribed, warmup,
    )


def summarize(arm: str, steps: Sequence[Step], static: Sequence[Step]) -> ArmSummary:
    times = [s.step_ms for s in steps]
    speedup = None
    if arm != "static":
        speedup = speedup_interval([s.step_ms for s in static], times)
    cp_sizes: Counter = Counter()
    for s in steps:
        cp_sizes.update({int(size): count for size, count in s.plan["cp_sizes"].items()})
    return ArmSummary(
        arm=arm,
        step_ms=median_interval(times),
        speedup=speedup,
        tokens_per_s=sum(s.plan["tokens"] for s in steps) / (sum(times) / 1e3),
        microbatches=statistics.mean(s.plan["microbatches"] for s in steps),
        cp_sizes=dict(sorted(cp_sizes.items())),
        plan_time_ms=statistics.median(s.plan["plan_time_s"] * 1e3 for s in steps),
        predicted_ms=statistics.median(s.predicted_ms for s in steps),
        fwd_bwd_ms=statistics.median(s.fwd_bwd_ms for s in steps),
        ratio_to_bound=statistics.median(
            s.plan["critical_path_s"] / s.plan["lower_bound_s"] for s in steps
        ),
    )


def plan_ordering(steps: Sequence[Step], arms: Sequence[str]) -> Ordering:
    """Every pair of arms on every batch: the critical paths under the shared cost model
    against the measured step times."""
    by_batch: Dict[int, Dict[str, Step]] = {}
    for s in steps:
        by_batch.setdefault(s.batch, {})[s.arm] = s
    pairs = []
    for runs in by_batch.values():
        for a, b in combinations(arms, 2):
            if a in runs and b in runs:
                pa, pb = runs[a].plan["critical_path_s"], runs[b].plan["critical_path_s"]
                pairs.append((pa, pb, runs[a].step_ms, runs[b].step_ms))
    return ordering(pairs)


def model_errors(steps: Sequence[Step]) -> Dict[str, float]:
    """The ``[DCP]`` line's prediction against its measurement, median over each window."""
    return window_errors([(s.iteration, s.predicted_ms, s.fwd_bwd_ms) for s in steps])


def window_errors(points: Sequence[Tuple[int, float, float]]) -> Dict[str, float]:
    """Median |predicted − measured| / measured over each of :data:`ERROR_WINDOWS` (keyed
    ``"first-last"``), from ``(iteration, predicted, measured)`` points."""
    errors = {}
    for first, last in ERROR_WINDOWS:
        window = [(p, m) for i, p, m in points if first <= i <= last]
        values = relative_errors([p for p, _ in window], [m for _, m in window])
        if values:
            errors[f"{first}-{last}"] = statistics.median(values)
    return errors
