"""Plan metrics, the one definition every tool and log line uses: per-rank loads and tokens of
a micro-batch, the critical path of a plan (Σ over micro-batches of the most-loaded rank's cost),
its fluid lower bound, and the load imbalance of a micro-batch."""

from __future__ import annotations

from typing import List, Sequence

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.plan import MicroBatch, Plan


def rank_loads(plan: Plan, microbatch: MicroBatch, cost: CostModel) -> List[float]:
    """Per-position cost of one micro-batch."""
    loads = [0.0] * plan.domain.size
    for group in microbatch.groups:
        load = cost.group_cost((plan.seqlens[i] for i in group.sample_ids), group.size)
        for rank in group.ranks:
            loads[rank] = load
    return loads


def rank_tokens(plan: Plan, microbatch: MicroBatch) -> List[float]:
    """Per-position tokens of one micro-batch."""
    tokens = [0.0] * plan.domain.size
    for group in microbatch.groups:
        for rank in group.ranks:
            tokens[rank] = group.tokens_per_rank(plan.seqlens)
    return tokens


def critical_path(plan: Plan, cost: CostModel) -> float:
    """Σ over micro-batches of the most-loaded rank's cost, plus every micro-batch's fixed cost."""
    loads = sum(max(rank_loads(plan, mb, cost)) for mb in plan.microbatches)
    return loads + cost.microbatch * plan.num_microbatches


def lower_bound(plan: Plan, cost: CostModel) -> float:
    """Fluid lower bound Σ_i (W_i + R_i) / N + K·microbatch, with W_i = c_i · per_rank(L_i, c_i)
    the total cost of sample i at its minimum CP size c_i, R_i = L_i · ring_cost(c_i) / budget
    its least share of ring steps, and K = ⌈Σ L / (N · budget)⌉ the fewest micro-batches the
    tokens fit in. It is a true lower bound of the critical path:

    - the total cost c · per_rank(L, c) = a·L + b·L²/η + comm·L·(c−1) (c > 1) never falls as c
      grows (η ≤ 1, comm ≥ 0; with a node layout, comm only grows once c crosses a node);
    - a group of c ≥ c_i ranks pays c · ring_cost(c) in all for at most c · budget tokens, so
      each of its tokens carries at least ring_cost(c_i) / budget of ring steps (ring_cost
      never falls as c grows: the inter-node factors are ≥ 1);
    - every micro-batch's most-loaded rank carries at least the micro-batch's mean load, and no
      plan has fewer than K micro-batches."""
    return fluid_lower_bound(plan.seqlens, plan.domain, cost)


def fluid_lower_bound(seqlens: Sequence[int], domain: Domain, cost: CostModel) -> float:
    """:func:`lower_bound` from the lengths alone (for schedules that are not a :class:`Plan`)."""
    total = 0.0
    for seqlen in seqlens:
        size = domain.cp_degree(seqlen)
        total += cost.per_rank(seqlen, size) * size + seqlen * cost.ring_cost(size) / domain.budget
    fewest = -(-sum(seqlens) // (domain.size * domain.budget))
    return total / domain.size + cost.microbatch * fewest


def imbalance(loads: Sequence[float]) -> float:
    """max/mean of per-rank loads (1.0 is perfect balance; 1.0 as well when nothing is loaded)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def plan_imbalance(plan: Plan, cost: CostModel) -> float:
    """Critical path over the sum of the micro-batches' mean per-rank loads: 1.0 when every
    micro-batch is balanced (what the ``[DCP]`` log line reports as the estimated imbalance)."""
    loads = [rank_loads(plan, microbatch, cost) for microbatch in plan.microbatches]
    mean = sum(sum(row) / len(row) for row in loads)
    return sum(max(row) for row in loads) / mean if mean > 0 else 1.0


__all__ = [
    "critical_path",
    "fluid_lower_bound",
    "imbalance",
    "lower_bound",
    "plan_imbalance",
    "rank_loads",
    "rank_tokens",
]
