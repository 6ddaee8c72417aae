"""The online refinement's solver (``scheduling/ridge.py``): moments combine as the points they
summarise; the fit finds the exact minimiser where features are nearly collinear (as the
micro-batch count, ring steps and K/V tokens of per-micro-batch points are), which coordinate
descent alone does not within its sweeps; it keeps to the bounds."""

import random

import pytest

from megatron_dcp.scheduling.ridge import (
    Moments,
    dot,
    residual_variance,
    ridge_of_moments,
    unbounded_ridge,
)

TRUE = [0.5, 2.0, 1.5, 0.8]


def collinear_points(count: int = 200, seed: int = 0, spread: float = 1e-3):
    """Points ``z`` with ``z · TRUE = 1`` exactly; the last two features nearly equal."""
    rng = random.Random(seed)
    points = []
    for _ in range(count):
        x = [rng.uniform(0.5, 2.0), rng.uniform(0.0, 1.0), rng.uniform(1.0, 2.0)]
        x.append(x[2] * (1 + spread * rng.uniform(-1, 1)))
        points.append([v / dot(x, TRUE) for v in x])
    return points


def test_moments_combine_as_the_points_they_summarise():
    first, second = collinear_points(30, seed=1), collinear_points(20, seed=2)
    combined = Moments.combine([Moments.of(first, 4), Moments.of(second, 4)], [0.5, 2.0])
    direct = Moments.of(first + second, 4, [0.5] * 30 + [2.0] * 20)
    assert combined.count == direct.count == 50 and combined.mass == pytest.approx(direct.mass)
    assert combined.rhs == pytest.approx(direct.rhs)
    for row, other in zip(combined.gram, direct.gram):
        assert row == pytest.approx(other)
    f = [0.6, 1.9, 1.4, 0.9]
    squares = sum(w * (dot(f, z) - 1) ** 2 for z, w in zip(first + second, [0.5] * 30 + [2.0] * 20))
    assert combined.squares(f) == pytest.approx(squares, rel=1e-9)
    assert residual_variance(combined, f, 1.0, 1e-4) == pytest.approx(
        squares / direct.mass * 50 / 46, rel=1e-9
    )


def test_nearly_collinear_features_are_solved_exactly():
    """Noise-free points, a weak prior: the exact minimiser is the truth to 10⁻³; 200 sweeps of
    coordinate descent from the anchor alone stop far from it on these points."""
    moments, anchor = Moments.of(collinear_points(), 4), [1.0] * 4
    f = ridge_of_moments(moments, anchor, 1e-9, (1e-2, 1e2), True, anchor)
    assert f == pytest.approx(TRUE, rel=1e-3)
    optimum, scale = unbounded_ridge(moments.gram, moments.rhs, anchor, 1e-9, True)
    assert f == optimum and scale == pytest.approx(sum(TRUE) / 4, rel=1e-3)


def test_a_minimiser_outside_the_bounds_is_clipped_and_polished():
    """Bounds [0.9, 1.1] × anchor around a truth well outside them: every factor within the
    bounds, and no worse than the clipped unbounded minimiser."""
    moments, anchor, bounds = Moments.of(collinear_points(spread=0.5), 4), [1.0] * 4, (0.9, 1.1)
    f = ridge_of_moments(moments, anchor, 1e-3, bounds, True, anchor)
    assert all(0.9 - 1e-12 <= x <= 1.1 + 1e-12 for x in f)
    optimum, _ = unbounded_ridge(moments.gram, moments.rhs, anchor, 1e-3, True)
    clipped = [min(1.1, max(0.9, x)) for x in optimum]
    assert moments.squares(f) <= moments.squares(clipped) + 1e-12
