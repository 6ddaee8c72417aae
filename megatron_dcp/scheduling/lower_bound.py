"""The lower bound of a plan's critical path, from the lengths alone.

``batch_lower_bound(seqlens, domain, cost, vpp, patches) = (Σ_i W_i + V + R + I) / N +
K · microbatch``:

- ``W_i = min_{c ≥ c_i} c · per_rank(L_i, c)``, sample i's least cost summed over its ranks
  on any CP size it may take. Without score spill that is its minimum CP size ``c_i``: a
  sample's total cost ``a·L + b·L²/η + comm·L·(c−1)`` never falls as c grows (η ≤ 1,
  comm ≥ 0; over nodes, comm only grows once c crosses a node). The spill term
  ``c · spill · max(0, L²/c − E)`` does fall with c, hence the minimum over sizes.
- ``V = Σ_i vision · P_i``, the vision encoder's work of the samples' ``P_i`` patches summed
  over ranks: a sample on c ranks costs each of them ``vision · P_i / c`` more, whatever c, so
  its ranks together always pay ``vision · P_i`` (0 without patches).
- ``K``, the fewest micro-batches: the tokens need ⌈Σ L / (N · budget)⌉ (at least one when
  there is a sample), rounded up to a multiple of the VPP group size.
- ``R ≤`` the ring steps every plan pays, summed over ranks: a group of c ranks that holds a
  sample pays ``c · ring_cost(c)``. Three bounds, the largest is taken:

  - **shares** (:func:`ring_shares`): each sample is charged a share ``f(L)`` of its group's
    ring steps such that no group can hold samples whose shares exceed what it pays. A sample
    longer than the next smaller size holds (``L > p · budget``, so it needs c ranks) is alone
    of its kind in a group of c, so it carries that group's whole ring cost less the most the
    rest of the group's tokens could carry: ``f_c(L) = c·ring(c) − (c·budget − L)·ρ(p)``, with
    ``ρ(p)`` the largest share per token of a sample that fits p ranks. That is at least the
    fluid share ``L · ring(c) / budget`` (a group packed to the budget) and much more for a
    sample that leaves its group half empty.
  - **coverage**: the groups of a micro-batch partition the N ranks and each holds a sample,
    so a micro-batch of m samples has at most m groups and pays Σ c·ring(c) ≥
    ring_step · (N²/m − N) (Cauchy–Schwarz); spread over K micro-batches (convexity) that is
    ``ring_step · N · K · (N·K/n − 1)`` for n samples. It bites when there are few samples
    per rank (long sequences, or micro-batches VPP adds).
  - **group counts** (``group_count_bound``): a linear program over how many groups of each
    size the plan has, which sees both at once: the groups must tile K micro-batches, number at
    most n, and give the long samples groups of their sizes.

- ``I``, the idle time of an odd half-domain sample (:func:`unpaired_half_idle`): a sample whose
  minimum CP size is N/2 takes half the domain; where no other such sample takes the other half
  of its micro-batch, that half holds only groups of shorter samples, whose per-rank cost the
  token budget caps below the sample's (or it takes the whole domain and pays its CP overhead).
  Vision work is not capped by tokens: the other half may carry up to all of ``V``, so the idle
  charge is lowered by ``V`` (never below 0).
- every micro-batch's most-loaded rank carries at least the micro-batch's mean load: the work
  (vision included), the ring steps and the idle time of its ranks over N.

``static_cp_lower_bound`` bounds the static-CP plan (``dp_balanced``) alone, every sample on a
group of exactly ``cp_size`` ranks: what lets DCP skip building that plan where it cannot win.

No plan that keeps the invariants of ``Plan.validate`` has a shorter critical path
(``tests/unit/scheduling/test_lower_bound.py`` checks every inequality above, and the property tests check
the bound against every scheduler's plans under random coefficients).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, Mapping, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel, SizeCosts, cost_keys
from megatron_dcp.scheduling.domain import Domain, is_power_of_two
from megatron_dcp.scheduling.group_count_bound import group_count_ring

# A share f(L) = base + rate · L per CP size (the minimum CP size of the sample).
Share = Tuple[float, float]


def batch_lower_bound(
    seqlens: Sequence[int],
    domain: Domain,
    cost: CostModel,
    vpp: Optional[int] = None,
    patches: Sequence[int] = (),
) -> float:
    """The lower bound of the module docstring for these lengths (sample id = index) and encoder
    ``patches`` (empty: none)."""
    if not seqlens:
        return 0.0
    vision = vision_work(patches, cost)
    shares = ring_shares(domain, cost)
    counts = Counter(seqlens)  # a batch repeats lengths
    degree = domain.cp_degrees(counts)
    terms: Dict[int, Tuple[float, float]] = {}  # by length: (W_i, share)
    work = shared = 0.0
    for seqlen in seqlens:
        if seqlen not in terms:
            size = degree[seqlen]
            base, rate = shares[size]
            terms[seqlen] = (
                least_work(cost, seqlen, size, domain.group_sizes),
                base + rate * seqlen,
            )
        least, share = terms[seqlen]
        work += least
        shared += share
    count = fewest_microbatches(seqlens, domain, vpp)
    covered = coverage_ring(len(seqlens), count, domain.size, cost)
    ring = max(shared, covered, group_count_ring(counts, domain, cost, count, degree))
    idle = unpaired_half_idle(counts, domain, cost, degree, vision)
    if vision:
        work += vision
    return (work + ring + idle) / domain.size + cost.microbatch * count


def vision_work(patches: Sequence[int], cost: CostModel) -> float:
    """``V = Σ_i vision · P_i``: the vision encoder's work of the samples, summed over ranks."""
    if not patches or not cost.vision:
        return 0.0
    return sum(cost.vision * p for p in patches if p)


def static_cp_lower_bound(
    seqlens: Sequence[int],
    domain: Domain,
    cost: CostModel,
    vpp: Optional[int] = None,
    patches: Sequence[int] = (),
) -> float:
    """No static-CP plan of ``seqlens`` (``dp_balanced``: every sample on one of the ``dp_size``
    groups of exactly ``c = cp_size`` ranks) has a shorter critical path than
    ``Σ_i per_rank(L_i, c) / dp + K · (ring_cost(c) + microbatch)``, K the fewest micro-batches
    (with ``patches``, ``per_rank`` is each sample's ``CostModel.sample_cost``, vision included).

    Proof: ``dp_balanced`` tries micro-batch counts from K up (:func:`fewest_microbatches`: its
    bins of c·budget tokens, dp per micro-batch, hold N·budget tokens, its count is a multiple
    of ``vpp``, and a count of 0 holds no sample) and returns a plan only when every one of its dp groups holds a sample, so each
    of its K' ≥ K micro-batches has dp groups that each pay ``ring_cost(c)``. The most-loaded
    rank of a micro-batch carries at least the mean of its dp groups' per-rank loads,
    ``Σ_{i in it} per_rank(L_i, c) / dp + ring_cost(c)``; summed over micro-batches with their
    fixed costs, the critical path is ≥ ``Σ_i per_rank(L_i, c) / dp + K' · (ring_cost(c) +
    microbatch)``, and costs are ≥ 0, so K' ≥ K keeps it above the bound.
    (``tests/unit/scheduling/test_static_shortcut.py`` checks it against ``dp_balanced``.)"""
    if not seqlens:
        return 0.0
    costs = SizeCosts(cost, domain.cp_size)
    keys = cost_keys(seqlens, patches, cost)
    work = sum(costs[key] for key in keys) / domain.dp_size
    fixed = cost.ring_cost(domain.cp_size) + cost.microbatch
    return work + fewest_microbatches(seqlens, domain, vpp) * fixed


def least_work(cost: CostModel, seqlen: int, size: int, sizes: Sequence[int]) -> float:
    """A sample's cost summed over its ranks on the CP size that makes it least: its minimum
    ``size`` unless a larger group keeps its score blocks in cache (``CostModel.spill``)."""
    least = cost.per_rank(seqlen, size) * size
    if not cost.spill:
        return least
    return min([least, *(cost.per_rank(seqlen, c) * c for c in sizes if c > size)])


def fewest_microbatches(seqlens: Sequence[int], domain: Domain, vpp: Optional[int]) -> int:
    """No plan of ``seqlens`` has fewer micro-batches: the tokens' need, at least one, rounded up
    to a multiple of ``vpp``."""
    count = max(1, -(-sum(seqlens) // (domain.size * domain.budget))) if seqlens else 0
    return -(-count // vpp) * vpp if vpp else count


def coverage_ring(samples: int, microbatches: int, ranks: int, cost: CostModel) -> float:
    """Least ring cost, summed over ranks, of ``microbatches`` micro-batches that cover ``ranks``
    ranks with groups of ``samples`` samples in all (each group holds one at least)."""
    if not samples:
        return 0.0
    spread = ranks * microbatches / samples - 1.0
    return cost.ring_step * ranks * microbatches * max(spread, 0.0)


def unpaired_half_idle(
    counts: Mapping[int, int],
    domain: Domain,
    cost: CostModel,
    degree: Optional[Mapping[int, int]] = None,
    vision: float = 0.0,
) -> float:
    """Least idle time (or CP overhead) summed over ranks that an odd count of *half-domain*
    samples (:func:`is_half_domain`: minimum CP size N/2, N a power of two, more than N/4 ·
    budget tokens, so that two never share a group of N/2 ranks) forces on every plan of the
    samples ``counts`` holds (length -> how many; ``degree``: each length's minimum CP size, when
    known); 0 for an even count.

    Where can a half-domain sample s go? (a) Onto a group of N ranks: it pays
    ``X_s = N · per_rank(L_s, N) − W_s`` more than its least work ``W_s``. (b) Onto one aligned
    half, the other half holding another half-domain sample: nothing is charged. (c) Onto one
    half, the other holding only groups of shorter samples (c ≤ N/2 ranks each): per-rank cost
    less each sequence's fixed cost, ``p(L) = per_rank(L, c) − sequence``, is convex in L and 0
    at L = 0, so ``p / L`` grows with L, and a group of T ≤ c · budget tokens in k sequences whose
    longest is ℓ costs at most ``T · p(ℓ) / ℓ + k · sequence + ring_cost(c)`` per rank. The largest such cap over sizes, ``G``
    (:func:`shorter_group_cap`), bounds every rank of that half, while the micro-batch's peak is
    at least s's group, ``per_rank(L_s, N/2) + ring_cost(N/2)``: the half idles
    ``N/2 · (peak − G)`` at least.

    Samples in (b) come two to a micro-batch, so with an odd count one sample at least is in (a)
    or (c): it is charged the lesser of the two, and the least charge over the samples is the
    bound. Work, ring steps and idle time are disjoint parts of the ranks' time, so the charge
    adds to ``Σ W_i + V + R``.

    With vision work (``vision``: V, summed over ranks; :func:`batch_lower_bound`), a rank r of
    the other half in (c) carries at most ``G + v_r``, v_r its vision work, which no token
    budget caps; s's own group carries its share of s's vision work on top of the peak above
    (≥ 0). The half then idles at least ``N/2 · (peak − G) − Σ_r v_r ≥ N/2 · (peak − G) − V``:
    (c) is charged ``max(0, N/2 · (peak − G) − V)``. (a) is unchanged: s's vision work is the
    same on N ranks as on any. ``vision`` = 0 is the text-only charge, bit for bit."""
    half = domain.size // 2
    if not is_power_of_two(domain.size) or half not in domain.group_sizes:
        return 0.0
    degree = degree or domain.cp_degrees(counts)
    halves = {length for length in counts if is_half_domain(length, degree[length], domain)}
    if sum(counts[length] for length in halves) % 2 == 0:
        return 0.0
    shorter = {L: n for L, n in counts.items() if degree[L] <= half and L not in halves}
    cap = shorter_group_cap(shorter, degree, domain, cost)
    charges = []
    for length in halves:
        whole = domain.size * cost.per_rank(length, domain.size)
        overhead = whole - least_work(cost, length, half, domain.group_sizes)
        alone = cost.per_rank(length, half) + cost.ring_cost(half)
        if cap is None:
            idle = math.inf
        elif vision:
            idle = max(0.0, half * (alone - cap) - vision)
        else:
            idle = half * max(0.0, alone - cap)
        charges.append(min(overhead, idle))
    return max(0.0, min(charges))


def is_half_domain(seqlen: int, degree: int, domain: Domain) -> bool:
    """True for a sample of minimum CP size (``degree``) N/2 with more than N/4 · budget
    tokens: two such samples never share a group of N/2 ranks, whatever the minimum CP size."""
    return 2 * degree == domain.size and 4 * seqlen > domain.size * domain.budget


def shorter_group_cap(
    shorter: Mapping[int, int], degree: Mapping[int, int], domain: Domain, cost: CostModel
) -> Optional[float]:
    """The most per-rank cost a group of c ≤ N/2 ranks can carry holding only the ``shorter``
    samples (length -> how many; :func:`unpaired_half_idle`), the largest over sizes of
    ``T · (per_rank(ℓ, c) − sequence) / ℓ + k · sequence + ring_cost(c)``: ℓ the longest of them
    that fits c ranks, T the least of c · budget and their tokens, k how many fit c ranks (each
    sequence's fixed cost, ``CostModel.sequence``, is no cost per token: the rest of
    ``per_rank`` is convex in L and 0 at L = 0). None when there are none (a half is then
    covered by a half-domain sample or not at all)."""
    longest: Dict[int, int] = {}  # by minimum CP size: the longest sample, tokens, samples
    tokens: Dict[int, int] = {}
    samples: Dict[int, int] = {}
    for length, number in shorter.items():
        size = degree[length]
        longest[size] = max(longest.get(size, 0), length)
        tokens[size] = tokens.get(size, 0) + length * number
        samples[size] = samples.get(size, 0) + number
    cap: Optional[float] = None
    most = total = count = 0
    for size in domain.group_sizes:
        if size > domain.size // 2:
            break
        if size in longest:
            most, total = max(most, longest[size]), total + tokens[size]
            count += samples[size]
        elif cap is None:
            continue  # no sample fits a group of this size
        held = min(size * domain.budget, total)
        work = held * (cost.per_rank(most, size) - cost.sequence) / most if most else 0.0
        fixed = count * cost.sequence + cost.ring_cost(size)
        cap = max(-math.inf if cap is None else cap, work + fixed)
    return cap


def ring_shares(domain: Domain, cost: CostModel) -> Dict[int, Share]:
    """Minimum CP size -> (base, rate) of the share ``f(L) = base + rate · L`` of ring cost a
    sample of that minimum size carries (module docstring). Sizes ascend; ``rho`` is the largest
    share per token of the sizes so far. The shares are feasible when every ``base`` ≥ 0 (a
    group holding only smaller samples pays at least their shares); otherwise, the fluid shares
    ``L · ring(c) / budget`` (base 0), which always are."""
    budget, shares = domain.budget, {}
    previous: Optional[int] = None
    rho = 0.0
    for size in domain.group_sizes:
        ring = cost.ring_cost(size)
        if previous is None:  # samples of the smallest size may share a group: the fluid share
            base, rate = 0.0, ring / budget
        else:
            base, rate = size * ring - size * budget * rho, rho
            if base < 0:
                return {c: (0.0, cost.ring_cost(c) / budget) for c in domain.group_sizes}
        shares[size] = (base, rate)
        rho = rate + (base / (previous * budget) if previous else 0.0)
        previous = size
    return shares
