"""Every global batch of the data planned by the three arms of ``bench-train`` (static CP,
DCP, Megatron dev's planner) under one cost model, with the simulator's report of each plan
(``compare.run_scheduler``), and what each arm's plans add up to."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling import CostModel, Scheduler, build_scheduler
from megatron_dcp.scheduling.metrics import critical_path
from megatron_dcp.tools.compare import (
    DEV_PEER_ALIAS,
    DomainSpec,
    SchedulerResult,
    run_scheduler,
    scheduler_kwargs,
)
from megatron_dcp.tools.plan_report import Report, report, timed_schedule

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
    # Per batch: the vision encoder's seconds on the critical path (None: no plan).
    encoder_s: List[Optional[float]] = field(default_factory=list)

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
    patches: Sequence[Sequence[int]] = (),
) -> Dict[str, ArmPlans]:
    """Every batch planned by every arm over ``spec``'s domain under ``cost`` (with each
    sample's encoder ``patches`` per batch, a vision-language batch: empty for text);
    ``on_batch(b)`` after batch ``b`` (1-based count) is planned (a progress line)."""
    arms = {arm: ArmPlans(arm) for arm in ARM_SCHEDULERS}
    model = spec.priced(cost)
    for index, lengths in enumerate(batches):
        counts = list(patches[index]) if patches else None
        for arm, name in ARM_SCHEDULERS.items():
            result, encoder = plan_arm(name, list(lengths), spec, model, counts)
            arms[arm].reports.append(result.report)
            arms[arm].encoder_s.append(encoder)
            if result.report is None and result.note not in arms[arm].notes:
                arms[arm].notes.append(result.note)
        on_batch(index + 1)
    return arms


def plan_arm(
    name: str,
    lengths: List[int],
    spec: DomainSpec,
    cost: CostModel,
    patches: Optional[List[int]] = None,
) -> Tuple[SchedulerResult, Optional[float]]:
    """The simulator's result of one arm on one batch (``compare.run_scheduler``) and, with
    ``patches``, the seconds of its critical path that are the vision encoder's: the critical
    path of the same plan less that plan priced without the ``vision`` term (0 for text)."""
    if not patches or not any(patches) or not cost.vision:
        result = run_scheduler(name, lengths, spec, cost)
        return result, (None if result.report is None else 0.0)
    try:
        scheduler = arm_scheduler(name, spec, cost)
        plan, elapsed = timed_schedule(scheduler, lengths, patches)
    except ValueError:  # no plan: run_scheduler words the note as it does for text
        return run_scheduler(name, lengths, spec, cost, patches=patches), None
    title = scheduler.name or name
    result = SchedulerResult(title, report(title, plan, cost, elapsed))
    without = critical_path(plan, replace(cost, vision=0.0))
    return result, critical_path(plan, cost) - without


def arm_scheduler(name: str, spec: DomainSpec, cost: CostModel) -> Scheduler:
    """The scheduler ``run_scheduler`` runs for an arm, built the same way."""
    if name == DEV_PEER_ALIAS:
        from megatron_dcp.tools.peers.megatron_dev_greedy import DevGreedyPeer

        return DevGreedyPeer(**scheduler_kwargs(spec, cost))
    return build_scheduler(name, **scheduler_kwargs(spec, cost))


def plans_by_batch(arms: Dict[str, ArmPlans]) -> Dict[int, Dict[str, Dict[str, float]]]:
    """The plans' critical paths in the shape of bench-train's ``plans.jsonl`` (batch -> arm ->
    ``critical_path_s``), what ``link_sweep.runs.predicted_speedups`` reads."""
    plans: Dict[int, Dict[str, Dict[str, float]]] = {}
    for arm, plans_of_arm in arms.items():
        for batch, report in enumerate(plans_of_arm.reports):
            if report is not None:
                plans.setdefault(batch, {})[arm] = {"critical_path_s": report.critical_path}
    return plans
