"""The node layout of a DP×CP domain: which CP groups cross a node boundary, and how much more
their K/V exchange and ring steps cost there.

A CP group whose ranks share a node runs its ring over the intra-node link (NVLink); a group
that spans nodes runs part of it over the inter-node network, and a ring is as slow as its
slowest link. :class:`NodeLayout` holds what the cost model needs: ``node_size``, the largest CP
group size whose every block lies inside one node, and the two inter-node factors. Groups are
aligned blocks of a power-of-two size (or the whole domain), so a group crosses a node exactly
when it is larger than ``node_size`` — when the node boundaries fall on power-of-two positions
(nodes of 8 GPUs, TP 1/2/4/8). Other layouts (nodes of 6 GPUs) get the conservative answer: a
size crosses as soon as one of its blocks does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.hardware import HardwareProfile
from megatron_dcp.scheduling.plan import Plan


@dataclass(frozen=True)
class NodeLayout:
    """Where a domain's node boundaries fall, and the inter-node price of a CP group's ring.

    ``comm_factor`` multiplies the exposed K/V exchange cost (``comm``) and ``ring_factor`` the
    ring-step cost (``ring_step``) of a group larger than ``node_size``; both are ≥ 1 (crossing
    a node never makes a ring cheaper, which keeps the lower bound a lower bound).
    """

    node_size: int
    comm_factor: float = 1.0
    ring_factor: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.node_size, int) or self.node_size < 1:
            raise ValueError(f"NodeLayout.node_size must be a positive int, got {self.node_size}")
        if min(self.comm_factor, self.ring_factor) < 1:
            raise ValueError(
                f"inter-node factors must be ≥ 1 (comm {self.comm_factor}, ring "
                f"{self.ring_factor}): a ring across nodes is never faster than inside one"
            )

    def crosses(self, cp_size: int) -> bool:
        """True when a CP group of ``cp_size`` ranks spans more than one node."""
        return cp_size > self.node_size

    @classmethod
    def of_positions(
        cls, domain: Domain, position_nodes: Sequence[int], hardware: HardwareProfile
    ) -> "NodeLayout":
        """The layout of ``domain`` whose position ``p`` runs on node ``position_nodes[p]``,
        priced with ``hardware``'s two link tiers."""
        comm_factor, ring_factor = hardware.inter_node_factors()
        return cls(intra_node_size(domain, position_nodes), comm_factor, ring_factor)


def intra_node_size(domain: Domain, position_nodes: Sequence[int]) -> int:
    """The largest CP group size of ``domain`` whose every block lies inside one node (sizes
    only grow across a node boundary: a block of a larger power of two contains smaller ones)."""
    if len(position_nodes) != domain.size:
        raise ValueError(
            f"{len(position_nodes)} node ids for a domain of {domain.size} positions: give one "
            "per position"
        )
    inside = 1
    for size in domain.group_sizes:
        if any(len({position_nodes[p] for p in b.positions}) > 1 for b in domain.blocks(size)):
            break
        inside = size
    return inside


def node_layout(
    domain: Domain,
    domain_ranks: Sequence[int],
    ranks_per_node: Optional[int],
    hardware: HardwareProfile,
) -> Optional[NodeLayout]:
    """The layout of ``domain`` whose position ``p`` is global rank ``domain_ranks[p]``, with
    ranks ``[k·R, (k+1)·R)`` on node ``k`` (:func:`contiguous_nodes`), priced by ``hardware``'s
    two link tiers; None without ``ranks_per_node`` (one node, one link tier)."""
    if ranks_per_node is None:
        return None
    nodes = contiguous_nodes(domain_ranks, ranks_per_node)
    return NodeLayout.of_positions(domain, nodes, hardware)


def contiguous_nodes(domain_ranks: Sequence[int], ranks_per_node: int) -> list:
    """Node id of each position whose global rank is ``domain_ranks[p]``, for launchers that
    place ranks ``[k·R, (k+1)·R)`` on node ``k`` (torchrun, ``srun`` with block distribution)."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node must be ≥ 1, got {ranks_per_node}")
    return [rank // ranks_per_node for rank in domain_ranks]


def crossing_groups(plan: Plan, nodes: NodeLayout) -> int:
    """How many CP groups of ``plan`` span more than one node of ``nodes``."""
    return sum(
        nodes.crosses(group.size) for microbatch in plan.microbatches for group in microbatch.groups
    )
