"""The solver of the online refinement (``cost_fit.OnlineRefinement``): bounded ridge least
squares of relative errors, pure Python.

A point ``z`` is one measured time's features in the refinement's units divided by the time, so
that ``z · f − 1`` is the relative error of the factors ``f``. The fit minimises
``Σ_p w_p ρ(z_p · f − 1) + weight · Σ_j (f_j / anchor_j − s)²`` with every ``f_j / anchor_j``
within ``bounds``. Squared losses need the points only through their :class:`Moments`
(``Σ w z zᵀ``, ``Σ w z``, ``Σ w``): the refinement keeps those per step, so that an update costs
the new step's points and not the window's. Everything is a fixed sequence of float operations:
every rank that feeds the same points gets the same floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

Vector = List[float]
# Coordinate-descent sweeps where the minimiser leaves the bounds (a fixed count: the same floats
# on every rank).
SWEEPS = 200
# Reweighting passes of the Huber loss (a fixed count: the same floats on every rank).
HUBER_PASSES = 6


def dot(x: Sequence[float], y: Sequence[float]) -> float:
    return sum(a * b for a, b in zip(x, y))


@dataclass(frozen=True)
class Moments:
    """What squared losses need of weighted points: ``gram = Σ w z zᵀ``, ``rhs = Σ w z``,
    ``mass = Σ w`` and the number of points ``count``."""

    gram: List[Vector]
    rhs: Vector
    mass: float
    count: int

    @classmethod
    def of(cls, points: Sequence[Vector], width: int, weights: Optional[Sequence[float]] = None):
        w = list(weights) if weights is not None else [1.0] * len(points)
        gram, rhs = [[0.0] * width for _ in range(width)], [0.0] * width
        for z, wp in zip(points, w):
            nonzero = [(i, x) for i, x in enumerate(z) if x]  # a point has 3-5 features
            for i, x in nonzero:
                rhs[i] += wp * x
                row = gram[i]
                for j, y in nonzero:
                    row[j] += wp * x * y
        return cls(gram, rhs, sum(w), len(points))

    @classmethod
    def combine(cls, parts: Sequence["Moments"], weights: Sequence[float]) -> "Moments":
        """``Σ_k weights_k · parts_k`` (each part's points all weighted alike)."""
        width = len(parts[0].rhs)
        gram = [
            [sum(w * m.gram[i][j] for m, w in zip(parts, weights)) for j in range(width)]
            for i in range(width)
        ]
        rhs = [sum(w * m.rhs[i] for m, w in zip(parts, weights)) for i in range(width)]
        mass = sum(w * m.mass for m, w in zip(parts, weights))
        return cls(gram, rhs, mass, sum(m.count for m in parts))

    def squares(self, f: Vector) -> float:
        """``Σ w (z · f − 1)²``, from the moments (never below 0)."""
        quadratic = dot(f, [dot(row, f) for row in self.gram])
        return max(0.0, quadratic - 2.0 * dot(self.rhs, f) + self.mass)


def residual_variance(moments: Moments, f: Vector, previous: float, floor: float) -> float:
    """The variance of the relative residuals ``z · f − 1`` (weighted mean of squares, corrected
    for the fitted factors: × n / (n − factors)), at least ``floor²``; ``previous`` while the
    points are no more than the factors."""
    n, width = moments.count, len(f)
    if n <= width or moments.mass <= 0:
        return previous
    return max(floor**2, moments.squares(f) / moments.mass * n / (n - width))


def bounded_ridge(
    points: Sequence[Vector],
    anchor: Vector,
    weight: float,
    bounds: Tuple[float, float],
    huber: Optional[float] = None,
    free_scale: bool = False,
    point_weights: Optional[Sequence[float]] = None,
) -> Vector:
    """``argmin Σ_p ρ(z_p · f − 1) + weight · Σ_j (f_j / anchor_j − s)²`` over
    ``bounds[0] ≤ f_j / anchor_j ≤ bounds[1]``: ``ρ`` the square, or Huber's loss with threshold
    ``huber`` (a point off by more counts linearly: a step slowed by another process moves the fit
    less); ``s`` 1, or free (``free_scale``: the prior holds the *shape* of the coefficients, not
    their level, so that a machine that runs uniformly slower or faster costs no penalty).
    Strictly convex (the weight term); iteratively reweighted: :data:`HUBER_PASSES` passes of
    :func:`ridge_of_moments` with Huber's weights of the previous residuals. ``point_weights``
    (default 1) multiply each point's term (the refinement's recency weights)."""
    f, width = list(anchor), len(anchor)
    base = list(point_weights) if point_weights is not None else [1.0] * len(points)
    weights = base
    for _ in range(HUBER_PASSES if huber else 1):
        moments = Moments.of(points, width, weights)
        f = ridge_of_moments(moments, anchor, weight, bounds, free_scale, f)
        if huber:
            residuals = [abs(dot(f, z) - 1.0) for z in points]
            weights = [w * (1.0 if r <= huber else huber / r) for w, r in zip(base, residuals)]
    return f


def ridge_of_moments(
    moments: Moments,
    anchor: Vector,
    weight: float,
    bounds: Tuple[float, float],
    free_scale: bool,
    start: Vector,
) -> Vector:
    """The bounded minimiser for squared losses: the minimiser without bounds
    (:func:`unbounded_ridge`) when it lies within them; else from it clipped to them (or from
    ``start`` when it is singular), :data:`SWEEPS` sweeps of exact coordinate minimisation (each
    factor clipped to its bounds, then the free scale ``s`` set to the mean of
    ``f_j / anchor_j``, its exact minimiser). The sweeps alone converge slowly where features are
    nearly collinear (per-micro-batch points: micro-batch count, ring steps and K/V tokens)."""
    gram, rhs, width = moments.gram, moments.rhs, len(anchor)
    low, high = bounds
    f, scale = list(start), 1.0
    optimum = unbounded_ridge(gram, rhs, anchor, weight, free_scale)
    if optimum is not None:
        clipped = [min(high * a, max(low * a, x)) for x, a in zip(optimum[0], anchor)]
        if clipped == optimum[0]:
            return clipped
        f, scale = clipped, optimum[1]
    for _ in range(SWEEPS):
        for j, a in enumerate(anchor):
            rest = sum(gram[j][k] * f[k] for k in range(width) if k != j)
            target = (rhs[j] - rest + weight * scale / a) / (gram[j][j] + weight / (a * a))
            f[j] = min(high * a, max(low * a, target))
        if free_scale:
            scale = sum(x / a for x, a in zip(f, anchor)) / width
    return f


def unbounded_ridge(
    gram: Sequence[Vector], rhs: Vector, anchor: Vector, weight: float, free_scale: bool
) -> Optional[Tuple[Vector, float]]:
    """``argmin fᵀ·gram·f − 2·rhs·f + weight · Σ_j (f_j / anchor_j − s)²`` without bounds, and
    its ``s`` (1 unless ``free_scale``): the normal equations, one more unknown for a free
    ``s`` (whose equation is Σ_j f_j / anchor_j = width · s); None when they are singular."""
    width = len(anchor)
    matrix = [
        [g + (weight / (a * a) if i == j else 0.0) for j, g in enumerate(row)]
        for i, (row, a) in enumerate(zip(gram, anchor))
    ]
    if not free_scale:
        solution = solve(matrix, [r + weight / a for r, a in zip(rhs, anchor)])
        return None if solution is None else (solution, 1.0)
    for row, a in zip(matrix, anchor):
        row.append(-weight / a)
    matrix.append([-1.0 / a for a in anchor] + [float(width)])
    solution = solve(matrix, [*rhs, 0.0])
    return None if solution is None else (solution[:width], solution[width])


def solve(matrix: List[List[float]], rhs: List[float]) -> Optional[Vector]:
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
