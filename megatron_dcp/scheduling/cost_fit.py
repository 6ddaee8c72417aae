"""Fitting the cost model to measured times: features, non-negative least squares, online
refinement (a windowed bounded ridge fit, solved in ``ridge``) and cost-profile files.

The cost of a plan is linear in nine coefficients once the CP efficiency η is folded into one
of them: ``θ = (a, b, b/η, comm, ring_step, microbatch, spill, sequence, vision)`` against the
:data:`FEATURES` of what a rank ran, ``(Σ L/c, Σ_{c=1} L², Σ_{c>1} L²/c, Σ_{c>1} L·(c−1)/c,
Σ_{groups} (c−1), micro-batches, Σ max(0, L²/c − E), sequences, Σ P/c)`` (P a sample's
vision-encoder patches, 0 for text); the cache size ``E`` (score elements) is a constant of the
hardware profile, never fitted. Feature rows of eight (recorded before the vision term) read as
rows without vision work.
:func:`group_features` and :func:`rank_features` compute them, :func:`fit` solves for ``θ``
(relative errors, ``θ ≥ 0``) and :func:`from_coefficients` turns ``θ`` back into a
:class:`CostModel`. Pure Python (the same floats on every rank, in the same order).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel, spilled_elements
from megatron_dcp.scheduling.plan import Plan
from megatron_dcp.scheduling.ridge import (
    Moments,
    Vector,
    bounded_ridge,
    residual_variance,
    ridge_of_moments,
    solve,
)
from megatron_dcp.scheduling.topology import NodeLayout

# Steps a refinement ignores at the start: the first iteration of a run pays one-time costs
# (process groups created lazily, allocator and autograd warm-up).
WARM_UP_STEPS = 1
FEATURES = (
    "linear", "quadratic", "quadratic_cp", "comm", "ring_step", "microbatch", "spill", "sequence",
    "vision",
)  # fmt: skip
MICROBATCH = FEATURES.index("microbatch")
PROFILE_FORMAT = "megatron_dcp.cost_profile/1"
# Online refinement (see OnlineRefinement and docs/cost_model.md "Replaying recorded runs",
# chosen by replaying recorded `bench-train` runs with `megatron-dcp replay-refinement` and
# checked with `python -m megatron_dcp.tools.refinement.convergence_bench`): the steps whose
# points the fit keeps; the weight that holds the factors to the anchor's shape, times σ² (a
# factor twice the others' level costs as much as 10 points off by σ: on contended CPU steps,
# σ ≈ 15 %, the shape holds; on clean ones, σ ≈ 1 %, the data moves it); the bounds (× anchor);
# Huber's threshold (None: squares); the free level; the half-life of a step's weight, in steps;
# the residual σ the first fit assumes, and its floor. (The replay's `before` variant, a fixed prior
# weight of 0.0005 with neither free level nor half-life, leaves the factors at their bounds in
# most iterations of a contended run.)
WINDOW = 20
PRIOR_WEIGHT = 10.0
BOUNDS = (1e-2, 1e2)
HUBER: Optional[float] = None
FREE_SCALE = True
HALF_LIFE: Optional[float] = 10.0
NOISE_SCALED = True
NOISE_START, NOISE_FLOOR = 0.1, 1e-4


def group_features(
    seqlens: Sequence[int],
    cp_size: int,
    nodes: Optional[NodeLayout] = None,
    spill_elements: float = math.inf,
    patches: Sequence[int] = (),
) -> Vector:
    """Features of one rank of a CP group of ``cp_size`` packing ``seqlens`` in one micro-batch
    (the micro-batch count is 0 here: :func:`rank_features` adds it). Over a node layout, a
    group that spans nodes counts its K/V and ring-step features times the layout's factors
    (the coefficients stay those of the intra-node tier). ``spill_elements``: the score elements
    of one sequence's block that stay in cache (``CostModel.spill_elements``); ``patches``: the
    samples' vision-encoder patches (empty: none), shared by the group's ranks (Σ P / c)."""
    lengths = list(seqlens)
    if not lengths:
        return [0.0] * len(FEATURES)
    c = cp_size
    tokens = float(sum(lengths))
    squares = float(sum(n * n for n in lengths))
    spilled = sum(spilled_elements(n, c, spill_elements) for n in lengths)
    count = float(len(lengths))
    vision = sum(patches) / c if patches else 0.0
    if c == 1:
        return [tokens, squares, 0.0, 0.0, 0.0, 0.0, spilled, count, vision]
    comm, ring = (nodes.comm_factor, nodes.ring_factor) if nodes and nodes.crosses(c) else (1, 1)
    comm_feature = comm * tokens * (c - 1) / c
    ring_feature = ring * (c - 1.0)
    return [tokens / c, 0.0, squares / c, comm_feature, ring_feature, 0.0, spilled, count, vision]


def rank_features(
    plan: Plan, nodes: Optional[NodeLayout] = None, spill_elements: float = math.inf
) -> List[Vector]:
    """Per position of the domain, the features of everything it runs in ``plan`` (over the
    node layout ``nodes``, with the cache size ``spill_elements``: see :func:`group_features`):
    the sum of its :func:`microbatch_features` (the same floats, added in micro-batch order)."""
    totals = []
    for rows in microbatch_features(plan, nodes, spill_elements):
        total = [0.0] * len(FEATURES)
        for row in rows:
            total = [x + y for x, y in zip(total, row)]
        totals.append(total)
    return totals


def microbatch_features(
    plan: Plan, nodes: Optional[NodeLayout] = None, spill_elements: float = math.inf
) -> List[List[Vector]]:
    """Per position, per micro-batch of ``plan``: the features of what the position runs in that
    micro-batch, its micro-batch count 1 (a position no group of a micro-batch holds runs it
    empty: only the count)."""
    rows = [[] for _ in range(plan.domain.size)]  # type: List[List[Vector]]
    for microbatch in plan.microbatches:
        for row in rows:
            row.append([0.0] * len(FEATURES))
        for group in microbatch.groups:
            lengths = [plan.seqlens[i] for i in group.sample_ids]
            patches = [plan.patches[i] for i in group.sample_ids] if plan.patches else ()
            values = group_features(lengths, group.size, nodes, spill_elements, patches)
            for rank in group.ranks:
                rows[rank][-1] = list(values)
        for row in rows:
            row[-1][MICROBATCH] += 1.0
    return rows


def microbatch_points(
    features: Sequence[Sequence[Vector]], times: Sequence[Sequence[float]]
) -> Tuple[List[Vector], Vector]:
    """The refinement's points of one step timed per micro-batch: ``features`` and ``times``
    both per position, per micro-batch (:func:`microbatch_features`, the measured seconds),
    flattened position by position."""
    if [len(f) for f in features] != [len(t) for t in times]:
        raise ValueError(
            f"per-micro-batch times of shape {[len(t) for t in times]} do not match the plan's "
            f"{[len(f) for f in features]} (positions × micro-batches)"
        )
    rows = [row for position in features for row in position]
    return rows, [t for position in times for t in position]


def coefficients(cost: CostModel) -> Vector:
    """``θ`` of ``cost`` (see the module docstring)."""
    return [
        cost.linear,
        cost.quadratic,
        cost.quadratic / cost.cp_efficiency,
        cost.comm,
        cost.ring_step,
        cost.microbatch,
        cost.spill,
        cost.sequence,
        cost.vision,
    ]


def from_coefficients(
    theta: Sequence[float],
    name: str = "fitted",
    nodes: Optional[NodeLayout] = None,
    spill_elements: float = math.inf,
) -> CostModel:
    """The cost model of ``θ``: η = b / (b/η), clamped to (0, 1] (CP attention is never faster
    than whole-sequence attention); with no whole-sequence data (b = 0) the CP rate is the rate.
    A ``θ`` of eight (before the vision term) has no vision work."""
    values = [*theta, *[0.0] * (len(FEATURES) - len(theta))]
    a, b, b_cp, comm, ring, microbatch, spill, sequence, vision = (
        max(0.0, float(x)) for x in values
    )
    if b <= 0:
        b, eta = b_cp, 1.0
    else:
        eta = min(1.0, b / b_cp) if b_cp > 0 else 1.0
    if a + b <= 0:
        raise ValueError(f"fitted coefficients {list(theta)} leave no work per token")
    if math.isinf(spill_elements):
        spill = 0.0
    return CostModel(
        a, b, comm, ring, eta, name, microbatch, nodes, spill, spill_elements, sequence, vision
    )


def predict(theta: Sequence[float], features: Sequence[float]) -> float:
    return sum(t * x for t, x in zip(theta, features))


def fit(rows: Sequence[Sequence[float]], times: Sequence[float]) -> Vector:
    """Non-negative least squares of relative errors: ``θ ≥ 0`` minimising
    Σ ((x·θ − t) / t)². Exact: every set of free coefficients is solved and the best feasible
    solution kept (the others stay 0)."""
    if len(rows) != len(times) or not rows:
        raise ValueError("fit needs as many feature rows as times, at least one")
    if min(times) <= 0:
        raise ValueError(f"measured times must be positive, got {min(times)}")
    scaled = [[x / t for x in row] for row, t in zip(rows, times)]
    width = len(rows[0])
    used = [j for j in range(width) if any(row[j] for row in scaled)]
    best: Tuple[float, Vector] = (math.inf, [0.0] * width)
    for count in range(1, len(used) + 1):
        for subset in itertools.combinations(used, count):
            theta = _least_squares(scaled, subset, width)
            if theta is None or min(theta) < 0:
                continue
            error = sum((predict(theta, row) - 1.0) ** 2 for row in scaled)
            if error < best[0]:
                best = (error, theta)
    return best[1]


def _least_squares(rows: Sequence[Sequence[float]], subset: Sequence[int], width: int):
    """Least squares of ``rows · θ ≈ 1`` over the coefficients in ``subset`` (others 0), by the
    normal equations with column scaling; None when they are singular."""
    norms = [math.sqrt(sum(row[j] ** 2 for row in rows)) or 1.0 for j in subset]
    cols = [[row[j] / n for j, n in zip(subset, norms)] for row in rows]
    k = len(subset)
    gram = [[sum(r[i] * r[j] for r in cols) for j in range(k)] for i in range(k)]
    rhs = [sum(r[i] for r in cols) for i in range(k)]
    solution = solve(gram, rhs)
    if solution is None:
        return None
    theta = [0.0] * width
    for j, value, n in zip(subset, solution, norms):
        theta[j] = value / n
    return theta


def relative_errors(theta: Sequence[float], rows, times) -> Vector:
    """|predicted − measured| / measured of every point."""
    return [abs(predict(theta, row) - t) / t for row, t in zip(rows, times)]


class OnlineRefinement:
    """Refines a prior cost model from measured step times: ``θ_j = prior_j · f_j``.

    The first ``WARM_UP_STEPS`` steps are ignored; the next one scales every factor by the
    median measured / predicted time (a prior off by a constant factor, another machine or
    model, is right at once: the *anchor*). From then on each step refits the factors to the
    points of the last ``window`` steps: bounded least squares of relative errors,
    ``Σ ρ(z · f − 1) + prior_weight · σ² · Σ_j (f_j / anchor_j − s)²`` with every factor within
    ``bounds`` times its anchor (``z`` a point's features in prior units over its measured
    time; see :func:`bounded_ridge`). With ``free_scale`` the prior holds the shape of the
    anchor, not its level (``s`` free: a uniformly slower machine costs nothing); with
    ``noise_scaled`` its weight is scaled by ``σ²``, the variance of the previous fit's
    residuals (:func:`residual_variance`), so noisy steps cannot trade coefficients while clean
    ones can; with ``half_life`` a step's points weigh ``2^(−age / half_life)``. The prior term
    keeps a direction the plans never (or barely) exercise with the others; the bounds keep
    every coefficient non-negative. A window, not a running estimate: a noisy step moves the
    fit by one point among ``window × ranks``, and a change of machine or load is forgotten
    after ``window`` steps. Deterministic: every rank feeds the same observations in the same
    order and gets the same floats (docs/cost_model.md has the settings' measurements)."""

    def __init__(
        self,
        prior: CostModel,
        window: int = WINDOW,
        bounds: Tuple[float, float] = BOUNDS,
        prior_weight: float = PRIOR_WEIGHT,
        huber: Optional[float] = HUBER,
        free_scale: bool = FREE_SCALE,
        half_life: Optional[float] = HALF_LIFE,
        noise_scaled: bool = NOISE_SCALED,
    ) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive number of steps, got {window!r}")
        if not prior_weight > 0:
            raise ValueError(
                f"prior_weight must be > 0, got {prior_weight}; it holds unexercised "
                f"coefficients at the prior (default PRIOR_WEIGHT = {PRIOR_WEIGHT:g})"
            )
        self.prior, self.window, self.bounds = prior, window, bounds
        self.prior_weight, self.huber, self.free_scale = prior_weight, huber, free_scale
        self.half_life, self.noise_scaled = half_life, noise_scaled
        self.variance = NOISE_START**2  # of the points' relative residuals (noise_scaled)
        self.scales = _scales(prior)
        self.factors = [1.0] * len(FEATURES)
        self.anchor = list(self.factors)
        self.points: List[List[Vector]] = []  # per kept step, its points z
        self.moments: List[Moments] = []  # per kept step, the moments of its points
        self.updates = 0

    @property
    def theta(self) -> Vector:
        return [f * s for f, s in zip(self.factors, self.scales)]

    @property
    def cost(self) -> CostModel:
        prior = self.prior
        return from_coefficients(self.theta, prior.name, prior.nodes, prior.spill_elements)

    def update(self, rows: Sequence[Sequence[float]], times: Sequence[float]) -> CostModel:
        """Take one step's observations (features and measured seconds: per position, or per
        position and micro-batch); returns the refined cost model. Points with no time are
        skipped, and so are the first ``WARM_UP_STEPS`` steps (one-time costs of a run's first
        iteration)."""
        self.updates += 1
        if self.updates <= WARM_UP_STEPS:
            return self.cost
        if self.updates == WARM_UP_STEPS + 1:
            self._rescale(rows, times)
        scales = self.scales
        step = [[x * s / t for x, s in zip(row, scales)] for row, t in zip(rows, times) if t > 0]
        self.points = [*self.points, step][-self.window :]
        self.moments = [*self.moments, Moments.of(step, len(FEATURES))][-self.window :]
        weight = self.prior_weight * (self.variance if self.noise_scaled else 1.0)
        steps = self.step_weights()
        moments = Moments.combine(self.moments, steps)
        if self.huber:
            points = [z for kept in self.points for z in kept]
            weights = [w for w, kept in zip(steps, self.points) for _ in kept]
            self.factors = bounded_ridge(
                points, self.anchor, weight, self.bounds, self.huber, self.free_scale, weights
            )
        else:
            self.factors = ridge_of_moments(
                moments, self.anchor, weight, self.bounds, self.free_scale, list(self.anchor)
            )
        if self.noise_scaled:
            self.variance = residual_variance(moments, self.factors, self.variance, NOISE_FLOOR)
        return self.cost

    def step_weights(self) -> List[float]:
        """Each kept step's weight: ``2^(−age / half_life)``, ``age`` its steps before the
        latest (1 without a half-life: every step alike)."""
        last = len(self.points) - 1
        if not self.half_life:
            return [1.0] * len(self.points)
        return [0.5 ** ((last - k) / self.half_life) for k in range(len(self.points))]

    def _rescale(self, rows: Sequence[Sequence[float]], times: Sequence[float]) -> None:
        """First step: the anchor is every factor times the median measured / predicted time."""
        theta = self.theta
        ratios = sorted(
            t / p for row, t in zip(rows, times) if t > 0 and (p := predict(theta, row)) > 0
        )
        if ratios:  # unbounded: a prior may be off by any factor (the H100 profile on CPU)
            scale = ratios[len(ratios) // 2]
            self.factors = self.anchor = [f * scale for f in self.factors]


def _scales(prior: CostModel) -> Vector:
    """The unit of each factor: the prior's coefficient, or (when the prior has none) a fixed
    share of the linear cost so that refinement can still grow it."""
    theta = coefficients(prior)
    unit = prior.linear or prior.quadratic
    # A prior without a cache size has no spill to refine (its spill feature is always 0).
    spill = 0.0 if math.isinf(prior.spill_elements) else unit / 1024
    # Nor does one whose kernels take a whole pack at once (sequence 0: the GPU profiles); a
    # calibrated profile (`calibrate` times packs of 1, 2 and 4 sequences) has its own.
    sequence = 0.0
    fallbacks = [unit, unit / 1024, unit / 1024, 0.01 * unit, 16 * unit, 16 * unit, spill, sequence]
    # Nor one without a vision encoder (vision 0: a text model; its plans have no patches).
    fallbacks.append(0.0)
    return [t if t > 0 else f for t, f in zip(theta, fallbacks)]


@dataclass(frozen=True)
class CostProfile:
    """A cost model saved to a file, with how it was obtained."""

    cost: CostModel
    source: Dict[str, Any]

    def to_json(self) -> str:
        c = self.cost
        data = {
            "format": PROFILE_FORMAT,
            "units": "seconds",
            "name": c.name,
            "coefficients": {
                "linear": c.linear,
                "quadratic": c.quadratic,
                "comm": c.comm,
                "ring_step": c.ring_step,
                "cp_efficiency": c.cp_efficiency,
                "microbatch": c.microbatch,
                "spill": c.spill,
                "spill_elements": None if math.isinf(c.spill_elements) else c.spill_elements,
                "sequence": c.sequence,
                "vision": c.vision,
            },
            "source": self.source,
        }
        return json.dumps(data, indent=2, sort_keys=True)


def save_profile(path: str, profile: CostProfile) -> None:
    with open(path, "w") as f:
        f.write(profile.to_json() + "\n")


def load_profile(path: str, flag: str = "--cost-profile") -> CostProfile:
    """The profile at ``path``; ValueError naming ``flag`` when it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"format is {data.get('format')!r}, expected {PROFILE_FORMAT!r}")
        values = data["coefficients"]
        cost = CostModel(
            values["linear"],
            values["quadratic"],
            values["comm"],
            values["ring_step"],
            values["cp_efficiency"],
            data.get("name", "profile"),
            values["microbatch"],
            spill=values.get("spill", 0.0),
            spill_elements=values.get("spill_elements") or math.inf,
            sequence=values.get("sequence", 0.0),  # profiles written before the term: none
            vision=values.get("vision", 0.0),  # profiles written before the vision term: none
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{flag}={path!r}: not a readable cost profile ({type(error).__name__}: {error}); "
            "write one with `megatron-dcp calibrate --output PATH`."
        ) from None
    return CostProfile(cost, data.get("source", {}))
