"""Fitting the cost model to measured times: features, non-negative least squares, online
refinement (recursive least squares with forgetting) and cost-profile files.

The cost of a plan is linear in six coefficients once the CP efficiency η is folded into one of
them: ``θ = (a, b, b/η, comm, ring_step, microbatch)`` against the :data:`FEATURES` of what a rank
ran, ``(Σ L/c, Σ_{c=1} L², Σ_{c>1} L²/c, Σ_{c>1} L·(c−1)/c, Σ_{groups} (c−1), micro-batches)``.
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

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.plan import Plan
from megatron_dcp.scheduling.topology import NodeLayout

# Steps a refinement ignores at the start: the first iteration of a run pays one-time costs
# (process groups created lazily, allocator and autograd warm-up).
WARM_UP_STEPS = 1
FEATURES = ("linear", "quadratic", "quadratic_cp", "comm", "ring_step", "microbatch")
PROFILE_FORMAT = "megatron_dcp.cost_profile/1"

Vector = List[float]


def group_features(
    seqlens: Sequence[int], cp_size: int, nodes: Optional[NodeLayout] = None
) -> Vector:
    """Features of one rank of a CP group of ``cp_size`` packing ``seqlens`` in one micro-batch
    (the micro-batch count is 0 here: :func:`rank_features` adds it). Over a node layout, a
    group that spans nodes counts its K/V and ring-step features times the layout's factors
    (the coefficients stay those of the intra-node tier)."""
    lengths = list(seqlens)
    if not lengths:
        return [0.0] * len(FEATURES)
    c = cp_size
    tokens = float(sum(lengths))
    squares = float(sum(n * n for n in lengths))
    if c == 1:
        return [tokens, squares, 0.0, 0.0, 0.0, 0.0]
    comm, ring = (nodes.comm_factor, nodes.ring_factor) if nodes and nodes.crosses(c) else (1, 1)
    return [tokens / c, 0.0, squares / c, comm * tokens * (c - 1) / c, ring * (c - 1.0), 0.0]


def rank_features(plan: Plan, nodes: Optional[NodeLayout] = None) -> List[Vector]:
    """Per position of the domain, the features of everything it runs in ``plan`` (over the
    node layout ``nodes``, see :func:`group_features`)."""
    rows = [[0.0] * len(FEATURES) for _ in range(plan.domain.size)]
    for microbatch in plan.microbatches:
        for group in microbatch.groups:
            values = group_features([plan.seqlens[i] for i in group.sample_ids], group.size, nodes)
            for rank in group.ranks:
                rows[rank] = [x + y for x, y in zip(rows[rank], values)]
        for row in rows:
            row[-1] += 1.0
    return rows


def coefficients(cost: CostModel) -> Vector:
    """``θ`` of ``cost`` (see the module docstring)."""
    return [
        cost.linear,
        cost.quadratic,
        cost.quadratic / cost.cp_efficiency,
        cost.comm,
        cost.ring_step,
        cost.microbatch,
    ]


def from_coefficients(
    theta: Sequence[float], name: str = "fitted", nodes: Optional[NodeLayout] = None
) -> CostModel:
    """The cost model of ``θ``: η = b / (b/η), clamped to (0, 1] (CP attention is never faster
    than whole-sequence attention); with no whole-sequence data (b = 0) the CP rate is the rate."""
    a, b, b_cp, comm, ring, microbatch = (max(0.0, float(x)) for x in theta)
    if b <= 0:
        b, eta = b_cp, 1.0
    else:
        eta = min(1.0, b / b_cp) if b_cp > 0 else 1.0
    if a + b <= 0:
        raise ValueError(f"fitted coefficients {list(theta)} leave no work per token")
    return CostModel(a, b, comm, ring, eta, name, microbatch, nodes)


def predict(theta: Sequence[float], features: Sequence[float]) -> float:
    return sum(t * x for t, x in zip(theta, features))


def fit(rows: Sequence[Sequence[float]], times: Sequence[float]) -> Vector:
    """Non-negative least squares of relative errors: ``θ ≥ 0`` minimising
    Σ ((x·θ − t) / t)². Exact for six unknowns: every set of free coefficients is solved and the
    best feasible solution kept (the others stay 0)."""
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
    solution = _solve(gram, rhs)
    if solution is None:
        return None
    theta = [0.0] * width
    for j, value, n in zip(subset, solution, norms):
        theta[j] = value / n
    return theta


def _solve(matrix: List[List[float]], rhs: List[float]) -> Optional[Vector]:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    k = len(rhs)
    m = [row[:] + [b] for row, b in zip(matrix, rhs)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-10:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][k] / m[i][i] for i in range(k)]


def relative_errors(theta: Sequence[float], rows, times) -> Vector:
    """|predicted − measured| / measured of every point."""
    return [abs(predict(theta, row) - t) / t for row, t in zip(rows, times)]


class OnlineRefinement:
    """Recursive least squares with forgetting on relative errors, in units of a prior cost
    model: ``θ_j = prior_j · f_j``. After ``WARM_UP_STEPS`` ignored steps, the first step scales
    all factors (and their variance) by the median measured / predicted time; then the factors move with variance ``1`` (so a handful of steps cannot move
    a coefficient the plans have not exercised away from the scaled prior) and stay within
    ``bounds``. Every rank feeds the same observations in the same order and gets the same
    floats."""

    def __init__(
        self,
        prior: CostModel,
        forgetting: float = 0.9,
        bounds: Tuple[float, float] = (1e-2, 1e2),
    ) -> None:
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.prior, self.forgetting, self.bounds = prior, forgetting, bounds
        self.scales = _scales(prior)
        width = len(FEATURES)
        self.factors = [1.0] * width
        self.covariance = [[float(i == j) for j in range(width)] for i in range(width)]
        self.updates = 0

    @property
    def theta(self) -> Vector:
        return [f * s for f, s in zip(self.factors, self.scales)]

    @property
    def cost(self) -> CostModel:
        return from_coefficients(self.theta, self.prior.name, self.prior.nodes)

    def update(self, rows: Sequence[Sequence[float]], times: Sequence[float]) -> CostModel:
        """Take one step's observations (features and measured seconds per rank); returns the
        refined cost model. Points with no time are skipped, and so are the first
        ``WARM_UP_STEPS`` steps (one-time costs of a run's first iteration)."""
        self.updates += 1
        if self.updates <= WARM_UP_STEPS:
            return self.cost
        if self.updates == WARM_UP_STEPS + 1:
            self._rescale(rows, times)
        lam = self.forgetting
        self.covariance = [[p / lam for p in row] for row in self.covariance]
        for row, t in zip(rows, times):
            if t > 0:
                self._observe([x * s / t for x, s in zip(row, self.scales)])
        low, high = self.bounds
        self.factors = [min(high, max(low, f)) for f in self.factors]
        return self.cost

    def _rescale(self, rows: Sequence[Sequence[float]], times: Sequence[float]) -> None:
        """First step: scale every factor by the median measured / predicted time, so that a
        prior off by a constant factor (another machine, another model) is right at once and
        the RLS steps only shape the coefficients."""
        theta = self.theta
        ratios = sorted(
            t / p for row, t in zip(rows, times) if t > 0 and (p := predict(theta, row)) > 0
        )
        if ratios:
            scale = ratios[len(ratios) // 2]
            low, high = self.bounds
            self.factors = [min(high, max(low, f * scale)) for f in self.factors]
            # The factors' uncertainty scales with them (variance by scale²).
            self.covariance = [[p * scale * scale for p in row] for row in self.covariance]

    def _observe(self, z: Vector) -> None:
        """One RLS step towards ``z · f = 1``."""
        p = self.covariance
        pz = [sum(p[i][j] * z[j] for j in range(len(z))) for i in range(len(z))]
        gain_denominator = 1.0 + sum(zi * pzi for zi, pzi in zip(z, pz))
        gain = [v / gain_denominator for v in pz]
        error = 1.0 - sum(f * zi for f, zi in zip(self.factors, z))
        self.factors = [f + g * error for f, g in zip(self.factors, gain)]
        self.covariance = [
            [p[i][j] - gain[i] * pz[j] for j in range(len(z))] for i in range(len(z))
        ]


def _scales(prior: CostModel) -> Vector:
    """The unit of each factor: the prior's coefficient, or (when the prior has none) a fixed
    share of the linear cost so that refinement can still grow it."""
    theta = coefficients(prior)
    unit = prior.linear or prior.quadratic
    fallbacks = [unit, unit / 1024, unit / 1024, 0.01 * unit, 16 * unit, 16 * unit]
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
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{flag}={path!r}: not a readable cost profile ({type(error).__name__}: {error}); "
            "write one with `megatron-dcp calibrate --output PATH`."
        ) from None
    return CostProfile(cost, data.get("source", {}))
