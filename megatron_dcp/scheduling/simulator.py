"""Simulator: the critical path of a plan against the fluid lower bound, and a per-plan report."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.plan import MicroBatch, Plan
from megatron_dcp.scheduling.registry import Scheduler


def rank_loads(plan: Plan, microbatch: MicroBatch, cost: CostModel) -> List[float]:
    """Per-position cost of one micro-batch."""
    loads = [0.0] * plan.domain.size
    for group in microbatch.groups:
        load = sum(cost.per_rank(plan.seqlens[i], group.size) for i in group.sample_ids)
        for rank in group.ranks:
            loads[rank] = load
    return loads


def rank_tokens(plan: Plan, microbatch: MicroBatch) -> List[float]:
    """Per-position tokens of one micro-batch."""
    tokens = [0.0] * plan.domain.size
    for group in microbatch.groups:
        for rank in group.ranks:
            tokens[rank] = group.tokens_per_rank(plan.seqlens)
    return tokens


def critical_path(plan: Plan, cost: CostModel) -> float:
    """Σ over micro-batches of the most-loaded rank's cost."""
    return sum(max(rank_loads(plan, mb, cost)) for mb in plan.microbatches)


def lower_bound(plan: Plan, cost: CostModel) -> float:
    """Fluid lower bound Σ_i W_i / N, with W_i the least total cost of sample i on any group it
    fits (its minimum CP size: the overhead of that size is unavoidable)."""
    return fluid_lower_bound(plan.seqlens, plan.domain, cost)


def fluid_lower_bound(seqlens: Sequence[int], domain: Domain, cost: CostModel) -> float:
    """:func:`lower_bound` from the lengths alone (for schedules that are not a :class:`Plan`)."""
    total = 0.0
    for seqlen in seqlens:
        size = domain.cp_degree(seqlen)
        total += cost.per_rank(seqlen, size) * size
    return total / domain.size


@dataclass
class Report:
    """One scheduler's figures on one workload."""

    scheduler: str
    critical_path: float
    lower_bound: float
    num_microbatches: int
    max_tokens_per_rank: float
    mean_tokens_per_rank: float
    cp_size_histogram: Dict[int, int] = field(default_factory=dict)
    plan_time_s: float = 0.0
    # Barrier-separated groups, for schedulers that have them (megatron-core's hybrid-CP peer).
    num_groups: Optional[int] = None

    @property
    def ratio(self) -> float:
        return self.critical_path / self.lower_bound if self.lower_bound else 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def report(name: str, plan: Plan, cost: CostModel, plan_time_s: float = 0.0) -> Report:
    tokens = [t for mb in plan.microbatches for t in rank_tokens(plan, mb)]
    return Report(
        scheduler=name,
        critical_path=critical_path(plan, cost),
        lower_bound=lower_bound(plan, cost),
        num_microbatches=plan.num_microbatches,
        max_tokens_per_rank=max(tokens, default=0.0),
        mean_tokens_per_rank=sum(tokens) / len(tokens) if tokens else 0.0,
        cp_size_histogram=plan.cp_size_histogram(),
        plan_time_s=plan_time_s,
    )


def timed_schedule(scheduler: Scheduler, seqlens: Sequence[int]) -> "tuple[Plan, float]":
    start = time.perf_counter()
    plan = scheduler.schedule(seqlens)
    return plan, time.perf_counter() - start


def simulate(scheduler: Scheduler, seqlens: Sequence[int]) -> Report:
    plan, elapsed = timed_schedule(scheduler, seqlens)
    return report(scheduler.name, plan, scheduler.cost_model, elapsed)


__all__ = [
    "Report",
    "critical_path",
    "fluid_lower_bound",
    "lower_bound",
    "rank_loads",
    "report",
    "simulate",
]
