"""Offline replay of a ``bench-train`` run's online refinement.

A ``bench-train`` output folder holds what the training run's refinement saw: every step's
measured busy seconds per position, in total and per micro-batch (``times.jsonl``), and every
arm's features per position, in total and per micro-batch (``plans.jsonl``; runs recorded before
per-micro-batch timing have the totals only, and are replayed from them); iteration ``t`` ran the
arm :func:`~megatron_dcp.tools.bench_train.arms.arm_at` gives. The prior
(the cost model iteration 1 planned with) is ``prior.json`` when the run wrote one, else it is
rebuilt from the run's flags (``bench_train.json``) as ``DCPConfig.from_args`` builds it.

:func:`replay` feeds those observations to an :class:`OnlineRefinement` built by a
:class:`Variant`, in the run's order, and predicts every step as the run did: iteration ``t``'s
plan was made (and its ``[DCP]`` prediction computed) with the cost model refined through step
``t − 2`` (the next plan is prepared while a step runs: ``DCPForwardBackward.use_cost_model``).
With the run's own refinement the predictions are the ``[DCP]`` line's; with another variant
they are what that variant would have predicted for the same plans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.cost_fit import (
    BOUNDS,
    FEATURES,
    FREE_SCALE,
    HALF_LIFE,
    HUBER,
    NOISE_SCALED,
    PRIOR_WEIGHT,
    WINDOW,
    OnlineRefinement,
    coefficients,
    load_profile,
    microbatch_points,
    predict,
)
from megatron_dcp.tools.bench_train.arms import arm_at
from megatron_dcp.tools.bench_train.results import read_plans, window_errors
from megatron_dcp.tools.bench_train.worker import PRIOR_FILE, TIMES_FILE
from megatron_dcp.tools.launching.training_runs import parse_log

RESULT_FILE = "bench_train.json"
LOG_FILE = "train.log"
# Steps between a measurement and the first plan it can change (see the module docstring).
PLAN_LAG = 2


@dataclass(frozen=True)
class RecordedStep:
    """One training iteration of a recorded run."""

    iteration: int
    arm: str
    features: List[List[float]]  # per position, ``cost_fit.FEATURES``
    times: List[float]  # per position, measured busy seconds
    logged_s: Optional[float] = None  # the ``[DCP]`` line's prediction, when the log has it
    # Per position, per micro-batch (None: recorded before per-micro-batch timing, or a step
    # whose seconds were not all claimed by a micro-batch: training fed the totals then).
    microbatch_features: Optional[List[List[List[float]]]] = None
    microbatch_times: Optional[List[List[float]]] = None

    def points(self):
        """The rows and times the run's refinement was fed for this step."""
        if self.microbatch_features is None or self.microbatch_times is None:
            return self.features, self.times
        return microbatch_points(self.microbatch_features, self.microbatch_times)


@dataclass(frozen=True)
class RecordedRun:
    path: Path
    arms: Tuple[str, ...]
    prior: CostModel
    steps: List[RecordedStep]


@dataclass(frozen=True)
class Variant:
    """How a refinement is built: :class:`OnlineRefinement`'s settings."""

    name: str
    window: int = WINDOW
    bounds: Tuple[float, float] = BOUNDS
    prior_weight: float = PRIOR_WEIGHT
    huber: Optional[float] = HUBER
    free_scale: bool = FREE_SCALE
    half_life: Optional[float] = HALF_LIFE
    noise_scaled: bool = NOISE_SCALED

    def refinement(self, prior: CostModel) -> OnlineRefinement:
        return OnlineRefinement(
            prior,
            self.window,
            self.bounds,
            self.prior_weight,
            self.huber,
            self.free_scale,
            self.half_life,
            self.noise_scaled,
        )


# The variants compared in docs/cost_model.md ("Replaying recorded runs"): ``current`` is the
# refinement training runs use, ``before`` the one this replay replaced, the others change one or
# two of its settings.
BEFORE = dict(
    window=20,
    bounds=(1e-2, 1e2),
    prior_weight=0.0005,
    huber=None,
    free_scale=False,
    half_life=None,
    noise_scaled=False,
)
# Each variant: the settings ``before`` had, with these changed.
CHANGES: Dict[str, Dict[str, object]] = {
    "prior-0.01": dict(prior_weight=0.01),
    "prior-0.1": dict(prior_weight=0.1),
    "bounds-0.1-10": dict(bounds=(0.1, 10.0)),
    "window-10": dict(window=10),
    "huber-0.1": dict(huber=0.1),
    "scale-0.1": dict(prior_weight=0.1, free_scale=True),
    "scale-0.3": dict(prior_weight=0.3, free_scale=True),
    "scale-0.3-hl10": dict(prior_weight=0.3, free_scale=True, half_life=10.0),
    "noise-3": dict(prior_weight=3.0, free_scale=True, half_life=10.0, noise_scaled=True),
    "noise-5": dict(prior_weight=5.0, free_scale=True, half_life=10.0, noise_scaled=True),
    "noise-10-hl3": dict(prior_weight=10.0, free_scale=True, half_life=3.0, noise_scaled=True),
    "noise-10-hl5": dict(prior_weight=10.0, free_scale=True, half_life=5.0, noise_scaled=True),
    "noise-30": dict(prior_weight=30.0, free_scale=True, half_life=10.0, noise_scaled=True),
}
VARIANTS: Dict[str, Variant] = {
    "current": Variant("current"),
    "before": Variant("before", **BEFORE),
    **{name: Variant(name, **{**BEFORE, **change}) for name, change in CHANGES.items()},
}


@dataclass(frozen=True)
class ReplayStep:
    iteration: int
    arm: str
    predicted_s: float
    measured_s: float
    logged_s: Optional[float]
    factors: List[float]  # after this step's update, × the prior's (the [DCP] line's)
    at_bound: List[str] = field(default_factory=list)  # names of the factors at a bound

    @property
    def error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s


def load_run(
    path: Path, hardware: str = "cpu-gloo", link_bandwidth: Optional[float] = None
) -> RecordedRun:
    """The recorded run in ``path`` (a ``bench-train --out`` folder); ``hardware`` is the
    profile the run priced with when it wrote no ``prior.json`` and its flags name none.
    ``link_bandwidth`` (bytes/s): replay from the prior that ``--dcp-link-bandwidth`` would
    have given the run (rebuilt from its flags)."""
    path = Path(path)
    result = json.loads((path / RESULT_FILE).read_text())
    arms = tuple(result["arms"])
    plans = read_plans(path)
    logged = {}
    if (path / LOG_FILE).exists():
        figures = parse_log(read(path / LOG_FILE)).dcp
        logged = {t: f.predicted_step_ms / 1e3 for t, f in figures.items()}
    steps = []
    for line in read(path / TIMES_FILE).splitlines():
        record = json.loads(line)
        batch, arm = arm_at(record["call"], arms)
        plan, call = plans[batch][arm], record["call"]
        timed = record.get("microbatch_times") and not any(record.get("unclaimed", [1.0]))
        steps.append(
            RecordedStep(
                call,
                arm,
                plan["features"],
                record["times"],
                logged.get(call),
                plan.get("microbatch_features") if timed else None,
                record["microbatch_times"] if timed else None,
            )
        )
    flags = list(result["flags"])
    if link_bandwidth is not None:
        flags += ["--dcp-link-bandwidth", str(link_bandwidth)]
    return RecordedRun(path, arms, run_prior(path, flags, hardware, link_bandwidth is None), steps)


def read(path: Path) -> str:
    return path.read_text(errors="replace")


def run_prior(path: Path, flags: Sequence[str], hardware: str, recorded: bool = True) -> CostModel:
    """The cost model the run planned iteration 1 with: its ``prior.json`` (when ``recorded``
    and there is one), else the one its flags give."""
    if recorded and (path / PRIOR_FILE).exists():
        return load_profile(str(path / PRIOR_FILE), flag=str(path / PRIOR_FILE)).cost
    from megatron_dcp.tools.quickstart import run_cost_model

    values = flag_values(flags)
    values.setdefault("--dcp-hardware-profile", hardware)
    values.setdefault("--tensor-model-parallel-size", 1)
    return run_cost_model(values)


def flag_values(flags: Sequence[str]) -> Dict[str, object]:
    """A flag list as ``{flag: value}`` (a flag without a value: True; numbers as numbers)."""
    values: Dict[str, object] = {}
    for i, flag in enumerate(flags):
        if not flag.startswith("--"):
            continue
        following = flags[i + 1] if i + 1 < len(flags) else "--"
        values[flag] = True if following.startswith("--") else number_or_text(following)
    return values


def number_or_text(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def replay(run: RecordedRun, variant: Variant = VARIANTS["current"]) -> List[ReplayStep]:
    """Every step of ``run`` predicted and then fed to ``variant``'s refinement, as the run did."""
    refinement = variant.refinement(run.prior)
    planned = [coefficients(refinement.cost)]  # θ after 0, 1, 2, ... updates
    out = []
    for index, step in enumerate(run.steps):
        theta = planned[max(0, index + 1 - PLAN_LAG)]
        predicted = max((predict(theta, row) for row in step.features), default=0.0)
        refinement.update(*step.points())
        planned.append(coefficients(refinement.cost))
        factors, measured = list(refinement.factors), max(step.times)
        at_bound = bound_names(refinement, variant.bounds)
        out.append(
            ReplayStep(
                step.iteration, step.arm, predicted, measured, step.logged_s, factors, at_bound
            )
        )
    return out


def bound_names(refinement: OnlineRefinement, bounds: Tuple[float, float]) -> List[str]:
    """The features whose factor sits at a bound (the bounds are relative to the anchor)."""
    low, high = bounds
    ratios = [f / a for f, a in zip(refinement.factors, refinement.anchor)]
    return [
        name
        for name, r in zip(FEATURES, ratios)
        if r <= low * (1 + 1e-9) or r >= high * (1 - 1e-9)
    ]


def replay_errors(steps: Sequence[ReplayStep]) -> Dict[str, float]:
    """Median |predicted − measured| / measured over each of ``results.ERROR_WINDOWS``."""
    return window_errors([(s.iteration, s.predicted_s, s.measured_s) for s in steps])


def bound_steps(steps: Sequence[ReplayStep], first: int = 5, last: int = 30) -> int:
    """Iterations in ``[first, last]`` that ended with a factor at a bound."""
    return sum(1 for s in steps if first <= s.iteration <= last and s.at_bound)


def step_table(steps: Sequence[ReplayStep]) -> str:
    """One line per iteration: predicted (and logged) against measured, the factors (× prior,
    ``*`` at a bound)."""
    lines = [
        f"{'iter':>4} {'arm':<13} {'pred ms':>9} {'logged ms':>9} {'meas ms':>9} {'err %':>6}  "
        + " ".join(f"{name[:6]:>7}" for name in FEATURES)
    ]
    for s in steps:
        logged = f"{s.logged_s * 1e3:9.1f}" if s.logged_s is not None else f"{'-':>9}"
        factors = " ".join(
            f"{f:6.3g}{'*' if name in s.at_bound else ' '}" for name, f in zip(FEATURES, s.factors)
        )
        lines.append(
            f"{s.iteration:4d} {s.arm:<13} {s.predicted_s * 1e3:9.1f} {logged} "
            f"{s.measured_s * 1e3:9.1f} {s.error * 100:6.1f}  {factors}"
        )
    return "\n".join(lines)


def summary_table(runs: Sequence[RecordedRun], variants: Sequence[Variant]) -> str:
    """Per run (rows) and variant (columns): the median model error over iterations 5–30 and
    the iterations of that window that ended with a factor at a bound."""
    head = f"{'run':<28}" + "".join(f"{v.name:>18}" for v in variants)
    lines = [head, f"{'':<28}" + "".join(f"{'err 5-30 (bound)':>18}" for _ in variants)]
    worst = {v.name: 0.0 for v in variants}
    for run in runs:
        cells = []
        for v in variants:
            steps = replay(run, v)
            error = replay_errors(steps).get("5-30", float("nan"))
            worst[v.name] = max(worst[v.name], error)
            cells.append(f"{error * 100:11.1f} % ({bound_steps(steps):2d})")
        lines.append(f"{run.path.name[-28:]:<28}" + "".join(f"{c:>18}" for c in cells))
    lines.append(f"{'worst run':<28}" + "".join(f"{worst[v.name] * 100:16.1f} %" for v in variants))
    return "\n".join(lines)


def parse_variants(text: str) -> List[Variant]:
    """``--variants current,prior-0.01``: known names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise ValueError(
            f"--variants={text}: choose from {', '.join(VARIANTS)} (comma-separated)."
        )
    return [VARIANTS[name] for name in names]
