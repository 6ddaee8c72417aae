"""The cap on the samples one CP group of a micro-batch holds: a rank's THD pack then has at most
that many sequences (Megatron dev's ``thd_max_packed_sequences``, what fixed-size ``cu_seqlens``
buffers and CUDA graphs need).

Any scheduler's plan is brought under the cap by one rule, so that every scheduler honours it the
same way: a group over the cap keeps its ``cap`` longest samples, and the samples it gives up are
planned again, by the same scheduler, as micro-batches of their own appended to the plan (their
count a multiple of the VPP group, as every plan's is; a batch too small for that, or for
static CP's DP ranks, first takes the shortest samples that other groups can spare). The new
micro-batches are brought under the cap the same way, on fewer samples each time. The cap binds only where
many short samples share one group; the planner's own construction does not see it, so a plan
that needs it can be longer than one built for it (docs/scheduling.md gives the measured cost).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.plan import CPGroup, MicroBatch

# Plans the samples of the given ids (of the whole batch) as a batch of their own (id = index).
Replan = Callable[[Sequence[int]], List[MicroBatch]]


def capped(
    microbatches: Sequence[MicroBatch], seqlens: Sequence[int], cap: int, replan: Replan
) -> List[MicroBatch]:
    """``microbatches`` with no group over ``cap`` samples; ``replan(ids)`` plans the samples
    ``ids`` (of the whole batch: their lengths and patches) as a batch of their own, sample id =
    index in ``ids``, with the same scheduler."""
    kept, excess = _keep_longest(microbatches, seqlens, cap)
    while excess:
        extra, kept, excess = _plan_excess(kept, excess, seqlens, replan)
        more, excess = _keep_longest(extra, seqlens, cap)
        kept += more
    return kept


def _plan_excess(
    kept: List[MicroBatch], excess: List[int], seqlens: Sequence[int], replan: Replan
) -> Tuple[List[MicroBatch], List[MicroBatch], List[int]]:
    """The micro-batches of the ``excess`` samples (ids of the whole batch). A batch too small
    to plan (fewer samples than a VPP group of micro-batches, or than the DP ranks static CP
    fills) takes the shortest spare sample of the kept plan (one whose group keeps another)
    until it can be planned: the returned kept plan and excess say which moved."""
    while True:
        try:
            extra = replan(tuple(excess))
            return [_renamed(mb, excess) for mb in extra], kept, excess
        except SchedulingError:
            spare = _shortest_spare(kept, seqlens)
            if spare is None:
                raise
            kept = [_without(mb, spare) for mb in kept]
            excess = excess + [spare]


def _shortest_spare(kept: Sequence[MicroBatch], seqlens: Sequence[int]) -> Optional[int]:
    spares = [i for mb in kept for g in mb.groups if len(g.sample_ids) > 1 for i in g.sample_ids]
    return min(spares, key=lambda i: (seqlens[i], i), default=None)


def _without(microbatch: MicroBatch, sample: int) -> MicroBatch:
    return MicroBatch(
        tuple(
            CPGroup(g.ranks, tuple(i for i in g.sample_ids if i != sample))
            for g in microbatch.groups
        )
    )


def _keep_longest(
    microbatches: Sequence[MicroBatch], seqlens: Sequence[int], cap: int
) -> Tuple[List[MicroBatch], List[int]]:
    """The micro-batches with each group cut to its ``cap`` longest samples, and the sample ids
    cut off (in the order they were found)."""
    kept, excess = [], []
    for microbatch in microbatches:
        groups = []
        for group in microbatch.groups:
            ids = sorted(group.sample_ids, key=lambda i: (-seqlens[i], i))
            excess += ids[cap:]
            groups.append(CPGroup(group.ranks, tuple(ids[:cap])) if len(ids) > cap else group)
        kept.append(MicroBatch(tuple(groups)))
    return kept, excess


def _renamed(microbatch: MicroBatch, ids: Sequence[int]) -> MicroBatch:
    """``microbatch`` of a sub-batch (ids index ``ids``) with the ids of the whole batch."""
    return MicroBatch(
        tuple(CPGroup(g.ranks, tuple(ids[i] for i in g.sample_ids)) for g in microbatch.groups)
    )
