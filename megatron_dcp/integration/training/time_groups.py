"""The groups a step's busy times travel over: the DP×CP domain, tensor parallelism and the
pipeline (``dcp_schedule.busy_times``), on the host.

The times are host floats (``BusyClock.per_microbatch``: read from CUDA events after the step's
one synchronisation). Gathered over NCCL they would go back to the GPU and their result would be
read back with a second synchronisation; so where a group is NCCL's, the times travel over a
gloo twin of it, made once (every rank takes part in making every twin: ``all_gather_object``
of each rank's three groups, then one ``new_subgroups_by_enumeration`` per kind). On gloo
already (the CPU backend) the groups themselves serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch.distributed as dist


@dataclass(frozen=True)
class TimeGroups:
    """Host (gloo) groups: the DP×CP domain, and TP and PP (None: a group of one rank)."""

    domain: Any
    tp: Optional[Any]
    pp: Optional[Any]


def model_parallel_groups() -> tuple:
    """megatron's tensor- and pipeline-parallel groups, None for a group of one rank."""
    from megatron.core import parallel_state

    groups = (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_pipeline_model_parallel_group(),
    )
    return tuple(g if dist.get_world_size(g) > 1 else None for g in groups)


def time_groups(domain_group: Any, twins: Optional[bool] = None) -> TimeGroups:
    """The host groups of this rank; ``twins``: make gloo twins (default: where a group is not
    gloo's). Collective over the whole job when it makes twins."""
    groups = (domain_group, *model_parallel_groups())
    if twins is None:
        twins = any(g is not None and dist.get_backend(g) != "gloo" for g in groups)
    return TimeGroups(*(gloo_twins(groups) if twins else groups))


def gloo_twins(groups: Sequence[Optional[Any]]) -> List[Optional[Any]]:
    """A gloo group of the same ranks for each of ``groups`` (None stays None)."""
    mine = [ranks_of(g) for g in groups]
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    twins = []
    for kind, own in enumerate(mine):
        if own is None:
            twins.append(None)
            continue
        enumeration = sorted({tuple(ranks[kind]) for ranks in everyone})
        twin, _ = dist.new_subgroups_by_enumeration([list(r) for r in enumeration], backend="gloo")
        twins.append(twin)
    return twins


def ranks_of(group: Optional[Any]) -> Optional[Tuple[int, ...]]:
    return None if group is None else tuple(dist.get_process_group_ranks(group))
