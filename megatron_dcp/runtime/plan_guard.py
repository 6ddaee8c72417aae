"""The plan-consistency guard: the ranks of a DP×CP domain check, once per global batch, that
they hold the same plan, so that a rank that planned differently (data that differs between
the CP ranks of one DP rank, a nondeterministic scheduler, settings that differ between ranks)
fails with an error naming the global batch and the first micro-batch that differs, instead of
hanging in the routing all-to-all or the model's collectives.

Cost: one all-reduce (MAX) of two int64 values over the domain per global batch: each rank's
63-bit plan digest and its negation, so one call yields the maximum and the minimum. Only when
they differ, a second collective gathers every rank's per-micro-batch digests to name the first
micro-batch that differs.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_dcp.runtime.exchange import collective_device
from megatron_dcp.scheduling import Plan


class PlanMismatchError(RuntimeError):
    """Ranks of one DP×CP domain hold different plans of the same global batch."""


def check_same_plan(plan: Plan, domain_group: Optional[ProcessGroup], step: int) -> None:
    """Raise :class:`PlanMismatchError` on every rank of ``domain_group`` when its ranks hold
    different plans of global batch ``step``; collective over the domain."""
    digest = plan.digest()
    device = collective_device(domain_group)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=domain_group)
    if int(extremes[0]) == digest == -int(extremes[1]):
        return
    digests: List[Tuple[int, ...]] = [()] * dist.get_world_size(domain_group)
    dist.all_gather_object(digests, plan.microbatch_digests(), group=domain_group)
    raise PlanMismatchError(
        mismatch_message(digests, step, dist.get_process_group_ranks(domain_group))
    )


def mismatch_message(digests: Sequence[Tuple[int, ...]], step: int, ranks: Sequence[int]) -> str:
    """Name the first micro-batch whose digest differs between ranks, the ranks that hold the
    most common plan there and those that do not (``digests`` by position in the domain)."""
    index = first_difference(digests)
    at_index = [d[index] if index < len(d) else None for d in digests]
    common = Counter(at_index).most_common(1)[0][0]
    agree = [rank for rank, value in zip(ranks, at_index) if value == common]
    differ = [rank for rank in ranks if rank not in agree]
    counts = sorted({len(d) for d in digests})
    return (
        f"DCP plan mismatch in global batch {step}: the ranks of the DP×CP domain {list(ranks)} "
        f"planned differently from micro-batch {index} on: ranks {differ} do not hold the plan "
        f"of ranks {agree} (micro-batch counts {counts}). Every rank of a domain must plan the "
        "same lengths with the same settings: check that the CP ranks of each DP rank read the "
        "same samples (same data iterator and seed) and that the DCP flags, the cost profile "
        "and --dcp-cost-adapt agree on every rank."
    )


def first_difference(digests: Sequence[Tuple[int, ...]]) -> int:
    """The first micro-batch index at which the ranks' digest lists differ (a missing
    micro-batch counts as a difference)."""
    longest = max(len(d) for d in digests)
    for index in range(longest):
        if len({d[index] if index < len(d) else None for d in digests}) > 1:
            return index
    return longest
