"""How fast online refinement finds the real machine: a simulator benchmark.

Training starts from a prior cost model (``CostModel.from_model_shape`` on a hardware profile)
and refines it after every step with :class:`~megatron_dcp.scheduling.cost_fit.OnlineRefinement`.
Here the "real machine" is a *world*: coefficients that differ from the prior's several-fold.
Every step draws a global batch from a reference workload, plans it with ``default_dynamic_cp``
under the model training would hold then (the model refined after a step plans the batch after
next, as ``DCPSchedule.refine`` / ``use_cost_model`` do), times every position with the world's
coefficients, one time per position and micro-batch as training measures them
(:func:`~megatron_dcp.scheduling.cost_fit.predict` of its
:func:`~megatron_dcp.scheduling.cost_fit.microbatch_features`, optionally times seeded
multiplicative noise; ``--totals``: one time per position, the sum, as training measured before)
and feeds those times to the refinement. Reported per world and workload: after how many
steps the refined coefficients stay within 10 % and 2 % of the world's, after how many the
micro-batch coefficient stays within 10 %, and after how many the
refined model's plans of a fixed set of held-out batches stay within 1 % of the plans made with
the world's coefficients (total critical path under the world's model). Pure Python.

``.venv/bin/python -m megatron_dcp.tools.refinement.convergence_bench`` prints the table.
"""

from __future__ import annotations

import argparse
import functools
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_dcp.integration.data.lengths import sample_lengths
from megatron_dcp.scheduling import build_scheduler
from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.cost_fit import (
    FEATURES,
    MICROBATCH,
    OnlineRefinement,
    Vector,
    coefficients,
    from_coefficients,
    microbatch_features,
    predict,
    rank_features,
)
from megatron_dcp.scheduling.hardware import hardware_profile
from megatron_dcp.scheduling.metrics import critical_path
from megatron_dcp.scheduling.model_shape import ModelShape
from megatron_dcp.tools.workloads import REFERENCE_WORKLOADS, Workload, parse_distribution

SCHEDULER = "default_dynamic_cp"
# Thresholds of the table: coefficients within 10 % and 2 %, plans within 1 %.
COEFFICIENT_TOLERANCES = (0.10, 0.02)
PLAN_TOLERANCE = 0.01
# Held-out batches are drawn with seeds from here on (training batches use seed + step).
HELD_OUT_SEED = 1_000_000
# The reference workloads the table runs by default (long-sft plans take 10× longer).
DEFAULT_WORKLOADS = ("lognormal", "rl-rollouts", "uniform")

RefinementFactory = Callable[[CostModel], OnlineRefinement]


@dataclass(frozen=True)
class World:
    """A machine the prior does not know: each coefficient named in ``factors`` (a name of
    cost_fit.FEATURES) is the prior's times its factor, the others are the prior's."""

    name: str
    description: str
    factors: Mapping[str, float]

    def theta(self, prior: CostModel) -> List[float]:
        return [self.factors.get(n, 1.0) * t for n, t in zip(FEATURES, coefficients(prior))]

    def cost(self, prior: CostModel) -> CostModel:
        return from_coefficients(self.theta(prior), self.name, prior.nodes, prior.spill_elements)


def _factors(a, b, b_cp, comm, ring, microbatch) -> Dict[str, float]:
    return dict(zip(FEATURES, (a, b, b_cp, comm, ring, microbatch)))


WORLDS: Tuple[World, ...] = (
    World(
        "latency-moe",
        "latency-heavy MoE: ring step and micro-batch ×5, comm ×2, linear ×0.5, b/η ×1.1",
        _factors(0.5, 1.0, 1.1, 2.0, 5.0, 5.0),
    ),
    World(
        "slow-attention",
        "attention kernels 2.5-3× slower, cheap ring (×0.5), comm ×0.5",
        _factors(0.8, 2.5, 3.0, 0.5, 0.5, 1.0),
    ),
    World(
        "cheap-ring",
        "ring step and micro-batch ×0.3, comm ×0.5, attention 1.5-2× slower",
        _factors(1.0, 1.5, 2.0, 0.5, 0.3, 0.3),
    ),
    World(
        "unit-test",
        "the unit test's world: a ×1.3, b ×0.7, b/η ×0.9, comm ×1.6, ring ×2.5, mb ×0.5",
        _factors(1.3, 0.7, 0.9, 1.6, 2.5, 0.5),
    ),
)


def default_prior(hardware: str = "h100-nvlink") -> CostModel:
    """Training's prior for the default (8B-like) model on ``hardware``: what
    ``integration.model_cost.cost_model_of`` builds."""
    return CostModel.from_model_shape(ModelShape(), hardware_profile(hardware))


def world_named(name: str) -> World:
    for world in WORLDS:
        if world.name == name:
            return world
    names = ", ".join(w.name for w in WORLDS)
    raise ValueError(f"--world={name!r}: unknown world; choose one of {names}.")


@functools.lru_cache(maxsize=None)
def batch_size(workload: Workload, microbatches: int) -> int:
    """Sequences per global batch (fixed, as in training): as many as one draw of the workload
    needs to fill ``microbatches`` full micro-batches (so the tokens per batch vary)."""
    total = microbatches * workload.domain_size * workload.budget
    dist = parse_distribution(workload.distribution)
    return len(sample_lengths(dist, HELD_OUT_SEED - 1, total_tokens=total))


def batch_of(workload: Workload, seed: int, microbatches: int) -> List[int]:
    """Global batch ``seed`` of ``workload``: :func:`batch_size` sequences."""
    count = batch_size(workload, microbatches)
    return sample_lengths(parse_distribution(workload.distribution), seed, num_sequences=count)


def scheduler_of(workload: Workload, cost: CostModel):
    return build_scheduler(
        SCHEDULER,
        dp_size=workload.dp_size,
        cp_size=workload.cp_size,
        max_seqlen_per_dp_cp_rank=workload.budget,
        cost_model=cost,
    )


def coefficient_error(theta: Sequence[float], truth: Sequence[float]) -> float:
    """The largest relative error over the coefficients."""
    return max(abs(got - want) / want for got, want in zip(theta, truth) if want > 0)


@dataclass
class HeldOut:
    """Fixed batches and the critical paths (under the world's model) of their true plans."""

    workload: Workload
    truth: CostModel
    batches: List[List[int]]
    best: float

    @classmethod
    def build(cls, workload: Workload, truth: CostModel, count: int, microbatches: int):
        batches = [batch_of(workload, HELD_OUT_SEED + k, microbatches) for k in range(count)]
        return cls(workload, truth, batches, cls.total(workload, truth, truth, batches))

    @staticmethod
    def total(workload: Workload, planner: CostModel, truth: CostModel, batches) -> float:
        scheduler = scheduler_of(workload, planner)
        return sum(critical_path(scheduler.schedule(batch), truth) for batch in batches)

    def gap(self, planner: CostModel) -> float:
        """How much longer (relative) the plans of ``planner`` take than the true plans."""
        return self.total(self.workload, planner, self.truth, self.batches) / self.best - 1.0


@dataclass
class Trace:
    """Per step (index 0: the prior, before any step), the coefficient and plan errors."""

    coefficient_errors: List[float]
    plan_gaps: List[float]
    microbatch_errors: List[float] = field(default_factory=list)  # |mb / world's mb − 1|
    # After the last step: each coefficient's signed relative error (0 where the truth is 0).
    final_errors: List[float] = field(default_factory=list)

    def worst_coefficient(self) -> str:
        """The coefficient furthest from the truth after the last step, e.g. ``ring_step -72%``."""
        j = max(range(len(self.final_errors)), key=lambda i: abs(self.final_errors[i]))
        return f"{FEATURES[j]} {100 * self.final_errors[j]:+.0f}%"


def run(
    world: World,
    workload: Workload,
    prior: CostModel,
    steps: int,
    noise: float = 0.0,
    held_out: int = 6,
    microbatches: int = 4,
    seed: int = 0,
    make_refinement: RefinementFactory = OnlineRefinement,
    per_microbatch: bool = True,
) -> Trace:
    """``steps`` training steps of ``workload`` on ``world`` starting from ``prior``, the
    refinement fed one time per position and micro-batch (``per_microbatch``, as training
    measures) or per position (the sum)."""
    theta, truth = world.theta(prior), world.cost(prior)
    check = HeldOut.build(workload, truth, held_out, microbatches)
    refinement = make_refinement(prior)
    scheduler, pending = scheduler_of(workload, prior), None
    noise_rng = random.Random(seed)
    trace = Trace([coefficient_error(coefficients(prior), theta)], [check.gap(prior)])
    trace.microbatch_errors.append(microbatch_error(coefficients(prior), theta))
    for step in range(steps):
        if pending is not None:  # the model given after the step before last
            scheduler.cost_model, pending = pending, None
        plan = scheduler.schedule(batch_of(workload, seed + step, microbatches))
        if per_microbatch:
            features = microbatch_features(plan, prior.nodes, prior.spill_elements)
            rows = [row for position in features for row in position]
        else:
            rows = rank_features(plan, prior.nodes, prior.spill_elements)
        times = [predict(theta, row) * (1 + noise * noise_rng.gauss(0, 1)) for row in rows]
        pending = refinement.update(rows, times)
        trace.coefficient_errors.append(coefficient_error(refinement.theta, theta))
        trace.microbatch_errors.append(microbatch_error(refinement.theta, theta))
        trace.plan_gaps.append(check.gap(refinement.cost))
    trace.final_errors = [g / t - 1 if t > 0 else 0.0 for g, t in zip(refinement.theta, theta)]
    return trace


def microbatch_error(theta: Vector, truth: Vector) -> float:
    """|refined / true − 1| of the micro-batch coefficient."""
    return abs(theta[MICROBATCH] / truth[MICROBATCH] - 1.0)


def steps_to(errors: Sequence[float], tolerance: float) -> Optional[int]:
    """The first step from which every error is within ``tolerance`` (None: never)."""
    reached = None
    for step, error in enumerate(errors):
        if error > tolerance:
            reached = None
        elif reached is None:
            reached = step
    return reached


def _steps_cell(errors: Sequence[float], tolerance: float) -> str:
    step = steps_to(errors, tolerance)
    return f">{len(errors) - 1}" if step is None else str(step)


def table_row(world: World, workload: Workload, trace: Trace) -> str:
    cells = [_steps_cell(trace.coefficient_errors, t) for t in COEFFICIENT_TOLERANCES]
    cells.append(_steps_cell(trace.microbatch_errors, COEFFICIENT_TOLERANCES[0]))
    cells.append(_steps_cell(trace.plan_gaps, PLAN_TOLERANCE))
    gaps = trace.plan_gaps
    return (
        f"{world.name:<15} {workload.name:<12} {cells[0]:>7} {cells[1]:>6} {cells[2]:>7}"
        f" {cells[3]:>9} {100 * gaps[0]:>8.1f}% {100 * max(gaps[-5:]):>8.2f}%"
        f"  {trace.worst_coefficient()}"
    )


def refinement_table(
    worlds: Sequence[str] = (),
    workloads: Sequence[str] = DEFAULT_WORKLOADS,
    steps: int = 30,
    noise: float = 0.0,
    held_out: int = 6,
    microbatches: int = 4,
    hardware: str = "h100-nvlink",
    seed: int = 0,
    make_refinement: RefinementFactory = OnlineRefinement,
    per_microbatch: bool = True,
) -> List[str]:
    """The benchmark's table, one line per (world, workload): steps until the coefficients stay
    within 10 % / 2 % of the world's, steps until the refined plans of the held-out batches stay
    within 1 % of the world's own plans, the prior's plan gap, the worst gap of the last five
    steps and the coefficient furthest from the world's at the end. ``worlds`` empty: all of
    :data:`WORLDS`; ``make_refinement`` builds the refinement under test from the prior;
    ``per_microbatch`` False feeds it per-position totals (:func:`run`)."""
    if steps < 1 or held_out < 1 or microbatches < 1 or noise < 0:
        raise ValueError(
            f"--steps={steps}, --held-out={held_out}, --microbatches={microbatches}, "
            f"--noise={noise}: pass counts ≥ 1 and a noise ≥ 0."
        )
    chosen = [world_named(name) for name in worlds] if worlds else list(WORLDS)
    by_name = {w.name: w for w in REFERENCE_WORKLOADS}
    for name in workloads:
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise ValueError(f"--workload={name!r}: unknown workload; choose one of {known}.")
    prior = default_prior(hardware)
    lines = _header(prior, steps, noise, held_out, microbatches, per_microbatch)
    for world in chosen:
        for name in workloads:
            trace = run(
                world,
                by_name[name],
                prior,
                steps,
                noise=noise,
                held_out=held_out,
                microbatches=microbatches,
                seed=seed,
                make_refinement=make_refinement,
                per_microbatch=per_microbatch,
            )
            lines.append(table_row(world, by_name[name], trace))
    return lines


def _header(prior: CostModel, steps, noise, held_out, microbatches, per_microbatch):
    theta = ", ".join(f"{n} {t:.3g}" for n, t in zip(FEATURES, coefficients(prior)))
    timed = "per position and micro-batch" if per_microbatch else "per position (totals)"
    return [
        f"prior {prior.name}: {theta} (seconds)",
        f"{steps} steps timed {timed}, noise {100 * noise:g} %, {held_out} held-out batches of "
        f"{microbatches} micro-batches' tokens; steps until the error stays within the tolerance",
        f"{'world':<15} {'workload':<12} {'θ ≤10%':>7} {'θ ≤2%':>6} {'mb ≤10%':>7} {'plans ≤1%':>9}"
        f" {'prior gap':>9} {'last gap':>9}  worst θ at the end",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_dcp.tools.refinement.convergence_bench",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("--world", action="append", default=[], help="default: every world")
    parser.add_argument(
        "--workload", action="append", default=[], help=f"default: {', '.join(DEFAULT_WORKLOADS)}"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--noise", type=float, default=0.0, help="relative σ of the times")
    parser.add_argument("--held-out", type=int, default=6)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hardware-profile", default="h100-nvlink")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--totals",
        action="store_true",
        help="feed one time per position (the step's sum), as training measured before",
    )
    args = parser.parse_args(argv)
    workloads = args.workload or DEFAULT_WORKLOADS
    try:
        lines = refinement_table(
            args.world,
            workloads,
            args.steps,
            args.noise,
            args.held_out,
            args.microbatches,
            args.hardware_profile,
            args.seed,
            per_microbatch=not args.totals,
        )
    except ValueError as error:
        parser.error(str(error))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
