"""Plan metrics, the one definition every tool and log line uses: per-rank loads and tokens of
a micro-batch, the critical path of a plan (Σ over micro-batches of the most-loaded rank's cost),
its lower bound, and the load imbalance of a micro-batch. Every cost includes the vision work of
the plan's samples (``Plan.patches``, priced by ``CostModel.vision``)."""

from __future__ import annotations

from typing import Dict, List, Sequence

from megatron_dcp.scheduling.cost import CostModel, SizeCosts, cost_keys
from megatron_dcp.scheduling.lower_bound import batch_lower_bound
from megatron_dcp.scheduling.plan import CPGroup, MicroBatch, Plan


def rank_loads(plan: Plan, microbatch: MicroBatch, cost: CostModel) -> List[float]:
    """Per-position cost of one micro-batch."""
    loads = [0.0] * plan.domain.size
    patches = plan.patches or None
    for group in microbatch.groups:
        ids = group.sample_ids
        counts = None if patches is None else [patches[i] for i in ids]
        load = cost.group_cost((plan.seqlens[i] for i in ids), group.size, counts)
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
    """Σ over micro-batches of the most-loaded rank's cost, plus every micro-batch's fixed cost.
    A rank's cost is its group's (:func:`rank_loads`, ``CostModel.group_cost``), summed in the
    same order from per-rank costs memoised by cost key (:class:`SizeCosts`: the length, or the
    length and patches): the same value, bit for bit, without a list of N loads per micro-batch
    (the planner prices plans of N = 4,096)."""
    tables: Dict[int, SizeCosts] = {}
    seqlens = cost_keys(plan.seqlens, plan.patches, cost)

    def group_load(group: CPGroup) -> float:
        if not group.sample_ids:
            return 0.0
        size = group.size
        if size not in tables:
            tables[size] = SizeCosts(cost, size)
        table = tables[size]
        return sum(table[seqlens[i]] for i in group.sample_ids) + cost.ring_cost(size)

    # Loads are ≥ 0: ranks no group covers (none in a valid plan) change no maximum.
    loads = sum(max(map(group_load, mb.groups), default=0.0) for mb in plan.microbatches)
    return loads + cost.microbatch * plan.num_microbatches


def lower_bound(plan: Plan, cost: CostModel) -> float:
    """No plan of these lengths over this domain (and VPP group size) has a shorter critical
    path: ``lower_bound.batch_lower_bound``, whose docstring gives the bound and its proof."""
    return batch_lower_bound(
        plan.seqlens, plan.domain, cost, plan.microbatch_group_size_per_vp_stage, plan.patches
    )


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
    "batch_lower_bound",
    "imbalance",
    "lower_bound",
    "plan_imbalance",
    "rank_loads",
    "rank_tokens",
]
