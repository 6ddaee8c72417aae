"""The node layout of a training job: how many ranks each node runs (``--dcp-ranks-per-node``,
else the launcher's environment), checked, and the log line of the :class:`NodeLayout` that prices
the CP groups crossing a node boundary (``scheduling.topology.node_layout`` builds it)."""

from __future__ import annotations

import os
from typing import Mapping, Optional

from megatron_dcp.scheduling.topology import NodeLayout

RANKS_PER_NODE_FLAG = "--dcp-ranks-per-node"
# Where launchers say how many ranks a node runs: torchrun, then SLURM (``srun`` sets a plain
# count when every node runs the same number of tasks).
RANKS_PER_NODE_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def ranks_per_node(
    flag_value: Optional[int], environ: Mapping[str, str] = os.environ
) -> Optional[int]:
    """``--dcp-ranks-per-node`` when given, else the first launcher variable that holds a
    positive count; None (one node, one link tier) when none does."""
    if flag_value is not None:
        if isinstance(flag_value, bool) or not isinstance(flag_value, int) or flag_value < 1:
            raise ValueError(
                f"{RANKS_PER_NODE_FLAG}={flag_value!r}: must be a positive number of ranks (GPUs "
                "per node, e.g. 8)."
            )
        return flag_value
    for name in RANKS_PER_NODE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def check_ranks_per_node(value: Optional[int], world_size: int) -> None:
    """Every node runs the same number of ranks: ``value`` divides the world size."""
    if value is not None and world_size % value:
        raise ValueError(
            f"{RANKS_PER_NODE_FLAG}={value}: the world size {world_size} is not a multiple of it; "
            "give the number of ranks every node runs."
        )


def describe_layout(layout: Optional[NodeLayout]) -> str:
    """One log line."""
    if layout is None:
        return "DCP nodes: no node layout (every CP group priced at the intra-node tier)"
    return (
        f"DCP nodes: CP groups of more than {layout.node_size} ranks cross nodes (K/V exchange "
        f"×{layout.comm_factor:.3g}, ring steps ×{layout.ring_factor:.3g})"
    )
