"""The arms of a training benchmark and the order they take turns in.

Every global batch is run once by every arm, one arm per training iteration: iteration ``t``
(1-based) runs batch ``(t - 1) // n`` with the arm at its turn ``(t - 1) % n``, the order rotated
by one each batch so that no arm always runs a batch first (a warmer cache) or last.

:class:`ArmRotation` stands in for the training run's scheduler: it plans each batch with every
arm at once, under the one cost model the run holds at that moment, records the plans' figures,
and hands out the plan of the arm whose turn it is.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_dcp.integration.model_cost import predicted_step_time
from megatron_dcp.scheduling import CostModel, Plan
from megatron_dcp.scheduling.cost_fit import microbatch_features, rank_features
from megatron_dcp.scheduling.dynamic_cp import DefaultDynamicCPScheduler
from megatron_dcp.scheduling.dp_balanced import DPBalancedScheduler
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
from megatron_dcp.scheduling.registry import Scheduler
from megatron_dcp.tools.peers.megatron_dev_greedy import DevGreedyPeer

# Arm name -> the scheduler class that plans it. ``static`` is static CP (every sequence on
# the configured CP size), ``dcp`` this package's planner, ``megatron_dev`` Megatron dev's.
ARMS: Dict[str, Callable[..., Scheduler]] = {
    "static": DPBalancedScheduler,
    "dcp": DefaultDynamicCPScheduler,
    "megatron_dev": DevGreedyPeer,
}
DEFAULT_ARMS = ("static", "dcp", "megatron_dev")
# Arms asked for that cannot run through this runtime, with the reason the report prints.
UNAVAILABLE = {
    "megatron_0.19.2": "megatron-core 0.19.2's BalancedCPScheduler runs one forward pass per "
    "sample between barriers, ranks idle while others still run theirs; a plan of this runtime "
    "puts every rank in one CP group of every micro-batch, so it cannot express that schedule",
}


def arm_at(iteration: int, arms: Sequence[str]) -> Tuple[int, str]:
    """The batch index and the arm of training iteration ``iteration`` (1-based)."""
    batch, turn = divmod(iteration - 1, len(arms))
    return batch, arms[(batch + turn) % len(arms)]


@dataclass(frozen=True)
class ArmPlan:
    """One arm's plan of one batch, priced by the cost model every arm of the batch shares."""

    arm: str
    predicted_s: float  # the busiest position's forward-backward seconds
    critical_path_s: float
    lower_bound_s: float
    microbatches: int
    cp_sizes: Dict[int, int]
    plan_time_s: float
    tokens: int
    features: List[List[float]]  # per position, ``cost_fit.FEATURES``
    microbatch_features: List[List[List[float]]]  # per position, per micro-batch
    sequences: List[List[Tuple[int, int]]]  # per position, (length, CP size) of what it runs
    patches: int = 0  # the batch's vision-encoder patches (0: a text batch)


class ArmRotation(Scheduler):
    """Plans with the arm whose turn it is (see the module docstring). ``record`` receives each
    batch's :class:`ArmPlan` of every arm when the batch is first planned; ``schedulers`` maps
    an arm's name to its scheduler class (default :data:`ARMS`)."""

    def __init__(
        self,
        arms: Sequence[str],
        record: Callable[[int, List[ArmPlan]], None],
        schedulers: Mapping[str, Callable[..., Scheduler]] = ARMS,
        **scheduler_kwargs,
    ) -> None:
        self.arms = tuple(arms)
        self.schedulers = {name: schedulers[name](**scheduler_kwargs) for name in self.arms}
        super().__init__(**scheduler_kwargs)
        self.record, self.calls = record, 0
        self.plans: Dict[str, Plan] = {}

    @property
    def cost_model(self) -> CostModel:
        return self._cost_model

    @cost_model.setter
    def cost_model(self, cost: CostModel) -> None:
        """Every arm plans with the run's cost model (the online refinement changes it)."""
        self._cost_model = cost
        for scheduler in getattr(self, "schedulers", {}).values():
            scheduler.cost_model = cost

    def schedule(self, seqlens, patches=None) -> Plan:
        """The plan of the arm whose turn it is; ``patches``: each sample's vision-encoder
        patches (a vision-language batch), which every arm's plan carries and prices."""
        batch, arm = arm_at(self.calls + 1, self.arms)
        if self.calls % len(self.arms) == 0:
            counts = None if patches is None else list(patches)
            self.plans = self.plan_every_arm(list(seqlens), batch, counts)
        self.calls += 1
        return self.plans[arm]

    def plan_every_arm(
        self, seqlens: List[int], batch: int, patches: Optional[List[int]] = None
    ) -> Dict[str, Plan]:
        plans, figures = {}, []
        for name, scheduler in self.schedulers.items():
            start = time.perf_counter()
            plans[name] = scheduler.schedule(seqlens, patches)
            figures.append(arm_plan(name, plans[name], self.cost_model, start))
        self.record(batch, figures)
        return plans


def arm_plan(name: str, plan: Plan, cost: CostModel, start: float) -> ArmPlan:
    elapsed = time.perf_counter() - start
    return ArmPlan(
        arm=name,
        predicted_s=predicted_step_time(plan, cost),
        critical_path_s=critical_path(plan, cost),
        lower_bound_s=lower_bound(plan, cost),
        microbatches=plan.num_microbatches,
        cp_sizes=plan.cp_size_histogram(),
        plan_time_s=elapsed,
        tokens=sum(plan.seqlens),
        features=rank_features(plan, cost.nodes, cost.spill_elements),
        microbatch_features=microbatch_features(plan, cost.nodes, cost.spill_elements),
        sequences=sequences_per_position(plan),
        patches=sum(plan.patches),
    )


def sequences_per_position(plan: Plan) -> List[List[Tuple[int, int]]]:
    runs: List[List[Tuple[int, int]]] = [[] for _ in range(plan.domain.size)]
    for microbatch in plan.microbatches:
        for group in microbatch.groups:
            for rank in group.ranks:
                runs[rank] += [(plan.seqlens[i], group.size) for i in group.sample_ids]
    return runs


def as_record(batch: int, figures: Sequence[ArmPlan]) -> Dict[str, object]:
    """One JSON line of the plans file."""
    return {"batch": batch, "arms": {f.arm: asdict(f) for f in figures}}


def parse_arms(text: str) -> Tuple[str, ...]:
    """``--arms static,dcp``: known names, no repeats, static first."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [n for n in names if n not in ARMS and n not in UNAVAILABLE]
    if unknown or len(set(names)) != len(names) or "static" not in names or len(names) < 2:
        raise ValueError(
            f"--arms={text}: give at least two distinct arms including static, from "
            f"{', '.join([*ARMS, *UNAVAILABLE])}; e.g. --arms {','.join(DEFAULT_ARMS)}."
        )
    return names


def runnable(arms: Sequence[str]) -> Tuple[Tuple[str, ...], Dict[str, str]]:
    """The arms this runtime can run, and the others with their reasons."""
    missing = {arm: UNAVAILABLE[arm] for arm in arms if arm in UNAVAILABLE}
    return tuple(arm for arm in arms if arm in ARMS), missing
