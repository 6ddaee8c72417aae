"""Every global batch of the data planned by the three arms of ``bench-train`` (static CP,
DCP, Megatron dev's planner) under one cost model, with the simulator's report of each plan
(``compare.run_scheduler``), and what each arm's plans add up to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from megatron_dcp.scheduling import CostModel
from megatron_dcp.tools.compare import DEV_PEER_ALIAS, DomainSpec, SchedulerResult, run_scheduler
from megatron_dcp.tools.plan_report import Report

# bench-train's arm name -> the scheduler the simulator runs for it.
ARM_SCHEDULERS = {
    "static": "dp_balanced",
    "dcp": "default_dynamic_cp",
    "megatron_dev": DEV_PEER_ALIAS,
}
ARM_TITLES = {"static": "static CP", "dcp": "DCP", "megatron_dev": "Megatron dev's planner"}


@dataclass
class ArmPlans:
    """One arm's plans of every batch: each batch's report, or why it has none."""

    arm: str
    reports: List[Optional[Report]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def planned(self) -> List[Report]:
        return [report for report in self.reports if report is not None]

    @property
    def complete(self) -> bool:
        """Every batch has a plan."""
        return bool(self.reports) and all(report is not None for report in self.reports)

    def title(self, cp_size: int) -> str:
        return f"static CP {cp_size}" if self.arm == "static" else ARM_TITLES[self.arm]

    def cp_size_histogram(self) -> Dict[int, int]:
        """Sequences per CP size over every planned batch."""
        total: Dict[int, int] = {}
        for report in self.planned:
            for size, count in report.cp_size_histogram.items():
                total[size] = total.get(size, 0) + count
        return dict(sorted(total.items()))

    def peak_tokens_per_rank(self) -> float:
        """The most tokens one rank holds in one micro-batch, over every batch."""
        return max((report.max_tokens_per_rank for report in self.planned), default=0.0)


def plan_batches(
    batches: Sequence[Sequence[int]],
    spec: DomainSpec,
    cost: CostModel,
    on_batch: Callable[[int], None] = lambda done: None,
) -> Dict[str, ArmPlans]:
    """Every batch planned by every arm over ``spec``'s domain under ``cost``; ``on_batch(b)``
    after batch ``b`` (1-based count) is planned (a progress line)."""
    arms = {arm: ArmPlans(arm) for arm in ARM_SCHEDULERS}
    model = spec.priced(cost)
    for index, lengths in enumerate(batches):
        for arm, name in ARM_SCHEDULERS.items():
            result: SchedulerResult = run_scheduler(name, list(lengths), spec, model)
            arms[arm].reports.append(result.report)
            if result.report is None and result.note not in arms[arm].notes:
                arms[arm].notes.append(result.note)
        on_batch(index + 1)
    return arms


def plans_by_batch(arms: Dict[str, ArmPlans]) -> Dict[int, Dict[str, Dict[str, float]]]:
    """The plans' critical paths in the shape of bench-train's ``plans.jsonl`` (batch -> arm ->
    ``critical_path_s``), what ``link_sweep.runs.predicted_speedups`` reads."""
    plans: Dict[int, Dict[str, Dict[str, float]]] = {}
    for arm, plans_of_arm in arms.items():
        for batch, report in enumerate(plans_of_arm.reports):
            if report is not None:
                plans.setdefault(batch, {})[arm] = {"critical_path_s": report.critical_path}
    return plans
