"""Simulator: run a scheduler on a batch of lengths and report its plan's figures (critical path
against the lower bound, micro-batches, tokens per rank, CP sizes, plan time)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Sequence

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.metrics import critical_path, lower_bound, rank_tokens
from megatron_dcp.scheduling.plan import Plan
from megatron_dcp.scheduling.registry import Scheduler
from megatron_dcp.scheduling.topology import crossing_groups


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
    # CP groups that span nodes, when the cost model has a node layout.
    crossing_groups: Optional[int] = None

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
        crossing_groups=crossing_groups(plan, cost.nodes) if cost.nodes else None,
    )


def timed_schedule(
    scheduler: Scheduler, seqlens: Sequence[int], patches: Optional[Sequence[int]] = None
) -> "tuple[Plan, float]":
    """The plan of ``seqlens`` (and each sample's encoder ``patches``) and its wall time."""
    start = time.perf_counter()
    plan = scheduler.schedule(seqlens, patches)
    return plan, time.perf_counter() - start


def simulate(scheduler: Scheduler, seqlens: Sequence[int]) -> Report:
    plan, elapsed = timed_schedule(scheduler, seqlens)
    return report(scheduler.name, plan, scheduler.cost_model, elapsed)
