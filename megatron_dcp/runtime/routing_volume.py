"""What each routing method moves, per rank, computed from the plan alone (no communication).

The two methods of ``runtime.routing`` trade bytes for connections: the all-to-all sends each
rank only the samples of its CP groups but may connect it to any rank of the DP×CP domain; the
lane all-gather connects it only to its CP lane (megatron's DP group, whose collective
connections exist anyway) but sends it the whole batch. Under NCCL the connections are what
costs memory (point-to-point buffers per connected peer, docs/scaling.md "Routing"), so both
figures are computed here, for any N, with the same arithmetic the routing functions use: the
figures measured by ``scripts/bench_routing.py`` at N = 8 equal these (tested), and the figures
it prints for N = 64 to 4,096 come from here.

Definitions (per position):

- ``bytes_received``: bytes that arrive over the wire (``RoutedSamples.bytes_received``);
- ``sources``: the ranks whose samples it receives (for the all-gather: every other rank of its
  lane, whose data reaches it relayed or direct);
- ``peers``: the ranks it sends to or receives from directly. The all-to-all sends point to
  point, so these are the ranks of its nonzero transfers, both ways. A ring all-gather (gloo's,
  and NCCL's ring algorithm) connects a rank to its two ring neighbours in the lane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron_dcp.runtime.routing import build_routing_table
from megatron_dcp.scheduling import Plan

OwnerFn = Callable[[int], int]


@dataclass(frozen=True)
class RankVolume:
    """What one position receives and sends in one routing, and with whom."""

    position: int
    bytes_received: int
    bytes_sent: int
    sources: frozenset[int]
    peers: frozenset[int]


def all_to_all_volume(
    plan: Plan, owner_of: OwnerFn, bytes_per_token: int, transfers: Optional[Sequence] = None
) -> list[RankVolume]:
    """Per position, the figures of ``route_samples`` for ``plan`` (one pass over the routing
    table, so it stays fast at thousands of ranks). ``transfers``: the table's, when built."""
    if transfers is None:
        transfers = build_routing_table(plan, owner_of).transfers
    size = plan.domain.size
    received, sent = [0] * size, [0] * size
    sources: list[set[int]] = [set() for _ in range(size)]
    peers: list[set[int]] = [set() for _ in range(size)]
    for t in transfers:
        nbytes = bytes_per_token * plan.seqlens[t.sample_id]
        received[t.dest] += nbytes
        sent[t.source] += nbytes
        sources[t.dest].add(t.source)
        peers[t.dest].add(t.source)
        peers[t.source].add(t.dest)
    return [
        RankVolume(p, received[p], sent[p], frozenset(sources[p]), frozenset(peers[p]))
        for p in range(size)
    ]


def lane_all_gather_volume(plan: Plan, owner_of: OwnerFn, bytes_per_token: int) -> list[RankVolume]:
    """Per position, the figures of ``route_by_lane_all_gather`` for ``plan``: every rank of a
    lane of d ranks receives (d − 1) buffers of the largest DP replica's payload."""
    dp_size, cp_size = plan.domain.dp_size, plan.domain.cp_size
    payload = [0] * dp_size
    for i, length in enumerate(plan.seqlens):
        payload[owner_of(i)] += bytes_per_token * length
    wire = max(payload) * (dp_size - 1)
    volumes = []
    for position in range(plan.domain.size):
        dp_rank, cp_rank = divmod(position, cp_size)
        lane = [d * cp_size + cp_rank for d in range(dp_size)]
        neighbours = {lane[(dp_rank - 1) % dp_size], lane[(dp_rank + 1) % dp_size]} - {position}
        sources = frozenset(lane) - {position}
        volumes.append(RankVolume(position, wire, wire, sources, frozenset(neighbours)))
    return volumes
