"""A lower bound on the ring steps every plan pays, from how many CP groups of each size a plan
must have: a small linear program over the group counts, bounded through its dual.

Let ``y_c`` be the number of groups of c ranks over the whole plan (all micro-batches). Every
plan of n samples in K' ≥ K micro-batches (K the fewest, ``lower_bound.fewest_microbatches``)
over N ranks satisfies:

- **slots**: its groups tile every micro-batch, ``Σ_c c · y_c = N · K' ≥ N · K``;
- **groups**: each holds a sample at least, ``Σ_c y_c ≤ n``;
- for every size t above the smallest, the samples of minimum CP size ≥ t (set ``H_t``) sit on
  groups of t ranks or more: **tokens**, ``Σ_{c ≥ t} c · budget · y_c ≥ Σ_{H_t} L``, and
  **counts**, ``Σ_{c ≥ t} k(c, t) · y_c ≥ |H_t|``, since each of them holds more than p · budget
  tokens (p the size below t) and a group of c ranks holds fewer than c / p of them:
  ``k(c, t) = ⌈c / p⌉ − 1``.

It pays ``Σ_c c · ring_cost(c) · y_c`` of ring steps summed over ranks. The least of that over
the ``y`` above (real or not) is a lower bound; any feasible solution of the dual program gives
one by weak duality, and that is what is computed: the dual is solved by the simplex method
(:func:`maximize`), then made exactly feasible (every multiplier ≥ 0; the groups multiplier, whose
column is −1 in every dual constraint, raised by the largest violation), and its objective is
the bound. Float error can only lower it, never make it invalid.

Where samples are few for the ranks to cover (VPP's added micro-batches) and long samples force
large groups at once, it exceeds both ring bounds of ``lower_bound`` (shares, coverage), which
each see one of the two.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Domain

# Simplex pivots before giving up (the bound is then 0: still a bound); the programs have one
# constraint per group size, a dozen at N = 4,096.
MAX_PIVOTS = 500
# Reduced costs and ratios below this are zero (values are costs of order 1e-3..1e5).
PIVOT_EPS = 1e-12


def group_count_ring(
    counts: Mapping[int, int],
    domain: Domain,
    cost: CostModel,
    microbatches: int,
    degree: Optional[Mapping[int, int]] = None,
) -> float:
    """The least ring cost, summed over ranks, of any plan of the samples ``counts`` holds
    (length -> how many) with at least ``microbatches`` micro-batches (module docstring); 0 when
    there is no sample. ``degree``: the minimum CP size of each length, when known."""
    if not counts or not microbatches:
        return 0.0
    sizes = domain.group_sizes
    rows = constraint_rows(counts, domain, microbatches, degree or domain.cp_degrees(counts))
    weights = [size * cost.ring_cost(size) for size in sizes]
    # Dual: maximize Σ_i rhs_i u_i subject to Σ_i A_ic u_i ≤ w_c for every size c, u ≥ 0.
    columns = [[row[0][c] for row in rows] for c in range(len(sizes))]
    solution = maximize([row[1] for row in rows], columns, weights)
    if solution is None:
        return 0.0
    return max(0.0, dual_value(rows, columns, weights, solution))


def constraint_rows(
    counts: Mapping[int, int], domain: Domain, microbatches: int, degree: Mapping[int, int]
) -> List[Tuple[List[float], float]]:
    """The primal constraints as ``Σ_c a_c · y_c ≥ rhs`` rows (coefficients by size): slots,
    groups (first two), then tokens and counts per size above the smallest."""
    sizes, budget = domain.group_sizes, domain.budget
    rows = [
        ([float(size) for size in sizes], float(domain.size * microbatches)),
        ([-1.0] * len(sizes), -float(sum(counts.values()))),
    ]
    samples, tokens = samples_by_degree(counts, degree)
    for below, size in zip(sizes, sizes[1:]):
        heavy = sum(samples.get(c, 0) for c in sizes if c >= size)  # |H_size|
        if not heavy:
            break
        held = sum(tokens.get(c, 0) for c in sizes if c >= size)
        rows.append(([float(c) if c >= size else 0.0 for c in sizes], held / budget))
        capacity = [float(-(-c // below) - 1) if c >= size else 0.0 for c in sizes]
        rows.append((capacity, float(heavy)))
    return rows


def samples_by_degree(
    counts: Mapping[int, int], degree: Mapping[int, int]
) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Minimum CP size -> (number of samples, their tokens)."""
    samples: Dict[int, int] = {}
    tokens: Dict[int, int] = {}
    for length, number in counts.items():
        size = degree[length]
        samples[size] = samples.get(size, 0) + number
        tokens[size] = tokens.get(size, 0) + length * number
    return samples, tokens


def dual_value(
    rows: Sequence[Tuple[List[float], float]],
    columns: Sequence[List[float]],
    weights: Sequence[float],
    solution: List[float],
) -> float:
    """The dual objective of ``solution`` made exactly feasible: multipliers clamped to ≥ 0,
    then the groups multiplier (row 1, coefficient −1 in every column) raised by the largest
    excess of a dual constraint over its weight."""
    u = [max(0.0, value) for value in solution]
    excess = max(sum(a * v for a, v in zip(column, u)) - w for column, w in zip(columns, weights))
    u[1] += max(0.0, excess)
    return sum(row[1] * v for row, v in zip(rows, u))


def maximize(
    objective: Sequence[float], columns: Sequence[Sequence[float]], limits: Sequence[float]
) -> Optional[List[float]]:
    """``max objective · u`` subject to ``columns[c] · u ≤ limits[c]`` for every c and u ≥ 0
    (``limits`` ≥ 0, so u = 0 is a feasible start): the simplex method on a dense tableau with
    Bland's rule (no cycling). None when unbounded or not done within ``MAX_PIVOTS``."""
    width = len(objective)
    tableau = [
        list(column) + [1.0 if k == c else 0.0 for k in range(len(columns))] + [limit]
        for c, (column, limit) in enumerate(zip(columns, limits))
    ]
    reduced = [-value for value in objective] + [0.0] * (len(columns) + 1)
    basis = [width + c for c in range(len(columns))]
    for _ in range(MAX_PIVOTS):
        entering = next((j for j, r in enumerate(reduced[:-1]) if r < -PIVOT_EPS), None)
        if entering is None:
            solution = [0.0] * width
            for row, var in zip(tableau, basis):
                if var < width:
                    solution[var] = row[-1]
            return solution
        leaving = leaving_row(tableau, basis, entering)
        if leaving is None:
            return None
        pivot(tableau, reduced, leaving, entering)
        basis[leaving] = entering
    return None


def leaving_row(tableau: List[List[float]], basis: List[int], entering: int) -> Optional[int]:
    """The row of least ratio ``rhs / a`` over ``a > 0`` (ties: the smallest basic variable,
    Bland's rule); None when no row bounds the entering variable."""
    best: Optional[Tuple[float, int, int]] = None
    for index, row in enumerate(tableau):
        if row[entering] > PIVOT_EPS:
            key = (row[-1] / row[entering], basis[index], index)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else best[2]


def pivot(tableau: List[List[float]], reduced: List[float], leaving: int, entering: int) -> None:
    """Make ``entering`` basic in row ``leaving``."""
    row = tableau[leaving]
    scale = row[entering]
    row[:] = [value / scale for value in row]
    for other in tableau + [reduced]:
        if other is not row and other[entering] != 0.0:
            factor = other[entering]
            other[:] = [value - factor * pivot_value for value, pivot_value in zip(other, row)]
