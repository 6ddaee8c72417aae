"""The planner's targets against Megatron dev's planner, checked over every run of a link-rate
sweep (docs/performance.md, "The missing term: a cost per sequence"):

- never slower than dev: in every run, the median of DCP over dev is ≥ 1.00 and its 95 %
  interval's upper end above 1;
- ahead on conversations where links are fast: on the SFT workload, unshaped and at 1 Gbit/s,
  the median over the repeated runs of DCP over dev is ≥ 1.03;
- model error ≤ 10 % in every run (median over iterations 5–30);
- near the limit: in every run, DCP's measured busiest-position time over the batch's lower
  bound (median over batches) is ≤ 1.10.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Sequence

from megatron_dcp.tools.link_sweep.runs import SweepRun
from megatron_dcp.tools.link_sweep.targets import Target, names

AHEAD_ON_SFT = 1.03
FAST_RATES = ("unshaped", "1gbit")
MODEL_ERROR = 0.10
NEAR_LIMIT = 1.10


def never_slower_than_dev(runs: Sequence[SweepRun]) -> Target:
    compared = [r for r in runs if r.dcp_over_dev is not None]
    slower = [r for r in compared if r.dcp_over_dev.value < 1 or r.dcp_over_dev.high <= 1]
    return Target(
        "never slower than dev: DCP over dev's median ≥ 1.00 and interval's upper end > 1",
        bool(compared) and not slower,
        f"{len(compared) - len(slower)}/{len(compared)} runs; slower: {names(slower)}",
    )


def ahead_on_sft(runs: Sequence[SweepRun]) -> Target:
    by_rate: Dict[str, List[float]] = {}
    for run in runs:
        if run.workload == "sft" and run.link.rate in FAST_RATES and run.dcp_over_dev:
            by_rate.setdefault(run.link.rate, []).append(run.dcp_over_dev.value)
    medians = {rate: statistics.median(values) for rate, values in by_rate.items()}
    detail = "; ".join(
        f"{rate}: median {medians[rate]:.3f} of {len(by_rate[rate])} run(s)" for rate in medians
    )
    return Target(
        f"SFT, unshaped and 1 Gbit/s: DCP over dev ≥ {AHEAD_ON_SFT:.2f} (median of the repeats)",
        len(medians) == len(FAST_RATES) and min(medians.values()) >= AHEAD_ON_SFT,
        detail or "no SFT run at these rates",
    )


def model_error_within(runs: Sequence[SweepRun]) -> Target:
    over = [r for r in runs if r.model_error is None or r.model_error > MODEL_ERROR]
    worst = max((r.model_error for r in runs if r.model_error is not None), default=None)
    detail = f"{len(runs) - len(over)}/{len(runs)} runs; over: {names(over)}"
    detail += f"; worst {worst:.1%}" if worst is not None else ""
    name = f"model error ≤ {MODEL_ERROR:.0%} in every run"
    return Target(name, bool(runs) and not over, detail)


def near_the_limit(runs: Sequence[SweepRun]) -> Target:
    far = [r for r in runs if r.distance.get("dcp", float("inf")) > NEAR_LIMIT]
    worst = max((r.distance.get("dcp", 0.0) for r in runs), default=0.0)
    return Target(
        f"DCP's measured time over the lower bound ≤ {NEAR_LIMIT:.2f} in every run",
        bool(runs) and not far,
        f"{len(runs) - len(far)}/{len(runs)} runs, worst {worst:.2f}; over: {names(far)}",
    )


def check_planner_targets(runs: Sequence[SweepRun]) -> List[Target]:
    return [
        never_slower_than_dev(runs),
        ahead_on_sft(runs),
        model_error_within(runs),
        near_the_limit(runs),
    ]
