"""Sample routing for one global batch (docs/architecture.md, "The life of one global batch").

Two ways to give every rank the samples of the CP groups it belongs to in the plan
(``--dcp-routing``, docs/runtime.md "Routing"):

- ``route_samples`` (``all-to-all``): one all-to-all over the DP×CP domain (one byte buffer per
  destination). In megatron every CP rank of a DP replica holds that replica's samples, so each
  (sample, destination) pair has ``cp_size`` possible senders; the routing table picks one so
  that the sending load is spread over them. Fewest bytes; a rank may exchange with any rank
  of the domain, which under NCCL costs point-to-point buffers per connected peer.
- ``route_by_lane_all_gather`` (``lane-all-gather``): one all-gather inside this rank's *CP
  lane*, the ranks at the same CP rank across the DP replicas (megatron's DP group of this
  rank, ``lane_positions``). One rank per replica sits in every lane and holds the replica's
  samples, so the lane together holds the whole batch: each rank receives all of it and keeps
  its groups' samples. More bytes; only the collective connections the DP group has anyway.

Facts about gloo (torch 2.13, CPU) that shape this module: list-form ``all_to_all`` and
``all_gather`` reject tensors of unequal sizes; ``all_to_all_single`` with uneven (and zero)
split sizes works, on sub-groups too, so a single uint8 buffer carries every field of every sample.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_dcp.scheduling import Plan

Sample = dict[str, Tensor]
OwnerFn = Callable[[int], int]
Device = Union[torch.device, str]

ALL_TO_ALL = "all-to-all"
LANE_ALL_GATHER = "lane-all-gather"
ROUTING_METHODS = (ALL_TO_ALL, LANE_ALL_GATHER)


# ---------------------------------------------------------------------------------------------
# 1. Routing table (pure Python; the same on every rank)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One sample sent from one position to another."""

    sample_id: int
    source: int
    dest: int


@dataclass(frozen=True)
class RoutingTable:
    """Who sends which sample to whom; positions that already hold a sample get no transfer."""

    needed: tuple[tuple[int, ...], ...]  # per position: sample ids of its CP groups, ascending
    transfers: tuple[Transfer, ...]  # sorted by (source, dest, sample_id)

    def sends(self, position: int) -> dict[int, list[int]]:
        """Sample ids ``position`` sends, by destination, in wire order."""
        out: dict[int, list[int]] = defaultdict(list)
        for t in self.transfers:
            if t.source == position:
                out[t.dest].append(t.sample_id)
        return dict(out)

    def receives(self, position: int) -> dict[int, list[int]]:
        """Sample ids ``position`` receives, by source, in wire order."""
        out: dict[int, list[int]] = defaultdict(list)
        for t in self.transfers:
            if t.dest == position:
                out[t.source].append(t.sample_id)
        return dict(out)


def needed_samples(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """Per position, the ids of the samples of every CP group it belongs to (all micro-batches)."""
    needed: list[set[int]] = [set() for _ in range(plan.domain.size)]
    for microbatch in plan.microbatches:
        for group in microbatch.groups:
            for position in group.ranks:
                needed[position].update(group.sample_ids)
    return tuple(tuple(sorted(ids)) for ids in needed)


def holders(plan: Plan, dp_rank: int) -> range:
    """Positions holding a DP rank's samples: its CP ranks (dp_rank·cp_size + cp_rank)."""
    cp_size = plan.domain.cp_size
    return range(dp_rank * cp_size, (dp_rank + 1) * cp_size)


def lane_positions(plan: Plan, position: int) -> range:
    """The CP lane of ``position``: the positions at its CP rank in every DP replica
    (``cp_rank``, ``cp_rank + cp_size``, ...), in DP-rank order. It is megatron's DP group of
    that rank, and it holds one copy of every DP replica's samples."""
    cp_size = plan.domain.cp_size
    return range(position % cp_size, plan.domain.size, cp_size)


def build_routing_table(plan: Plan, owner_of: OwnerFn) -> RoutingTable:
    """Pick one sender per (sample, destination) among the owner's CP ranks.

    Longest sample first, each to the holder that has sent the fewest tokens so far (ties: the
    lowest position), so sending load spreads over the CP ranks of the owning DP replica.
    Deterministic: every rank computes the same table from the same plan.
    """
    owners = [_checked_owner(owner_of, i, plan.domain.dp_size) for i in range(len(plan.seqlens))]
    needed = needed_samples(plan)
    pairs = [
        (i, dest)
        for dest, ids in enumerate(needed)
        for i in ids
        if dest not in holders(plan, owners[i])
    ]
    pairs.sort(key=lambda pair: (-plan.seqlens[pair[0]], pair))
    sent_tokens = [0] * plan.domain.size
    transfers = []
    for i, dest in pairs:
        source = min(holders(plan, owners[i]), key=lambda p: (sent_tokens[p], p))
        sent_tokens[source] += plan.seqlens[i]
        transfers.append(Transfer(i, source, dest))
    transfers.sort(key=lambda t: (t.source, t.dest, t.sample_id))
    return RoutingTable(needed=needed, transfers=tuple(transfers))


def _checked_owner(owner_of: OwnerFn, sample_id: int, dp_size: int) -> int:
    owner = owner_of(sample_id)
    if not isinstance(owner, int) or not 0 <= owner < dp_size:
        raise ValueError(f"owner_of({sample_id}) = {owner!r}: must be a DP rank in [0, {dp_size})")
    return owner


# ---------------------------------------------------------------------------------------------
# 2. Samples on the wire
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleSchema:
    """The fields every sample carries: names and dtypes of equal-length 1-D tensors, in order."""

    fields: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def of(cls, sample: Mapping[str, Tensor]) -> "SampleSchema":
        return cls(tuple((name, sample[name].dtype) for name in sorted(sample)))

    @property
    def bytes_per_token(self) -> int:
        return sum(dtype.itemsize for _, dtype in self.fields)

    def check(self, sample_id: int, sample: Mapping[str, Tensor], length: int) -> None:
        """Raise ValueError unless ``sample`` has exactly these fields, 1-D, of ``length``."""
        if sorted(sample) != [name for name, _ in self.fields]:
            raise ValueError(
                f"sample {sample_id} has fields {sorted(sample)}; every sample must have "
                f"{[name for name, _ in self.fields]}"
            )
        for name, dtype in self.fields:
            tensor = sample[name]
            if tensor.dtype != dtype or tensor.dim() != 1 or tensor.numel() != length:
                raise ValueError(
                    f"sample {sample_id} field {name!r}: {tuple(tensor.shape)} {tensor.dtype}; "
                    f"expected ({length},) {dtype} (the length comes from the plan's seqlens)"
                )


@dataclass(frozen=True)
class RoutedSamples:
    """The samples a rank computes (its CP groups' samples), and what moving them cost it."""

    samples: Mapping[int, Sample]  # sample id -> fields, ascending ids
    bytes_received: int  # over the wire
    bytes_sent: int  # over the wire
    bytes_local: int  # of ``samples``, already held by this rank (no transfer)

    @property
    def bytes_needed(self) -> int:
        """Bytes of every sample this rank computes."""
        return self.bytes_received + self.bytes_local


def _sample_bytes(schema: SampleSchema, plan: Plan, ids: Sequence[int]) -> int:
    return schema.bytes_per_token * sum(plan.seqlens[i] for i in ids)


def _pack(
    ids_by_dest: Mapping[int, Sequence[int]],
    samples: Mapping[int, Sample],
    schema: SampleSchema,
    num_dests: int,
    device: Device,
) -> tuple[Tensor, list[int]]:
    """One uint8 buffer: for each destination in order, its samples' fields back to back."""
    pieces: list[Tensor] = []
    splits: list[int] = []
    for dest in range(num_dests):
        chunk = [
            samples[i][name].contiguous().view(torch.uint8)
            for i in ids_by_dest.get(dest, ())
            for name, _ in schema.fields
        ]
        pieces.extend(chunk)
        splits.append(sum(piece.numel() for piece in chunk))
    if not pieces:
        return torch.empty(0, dtype=torch.uint8, device=device), splits
    return torch.cat(pieces), splits


def _unpack(
    buffer: Tensor,
    ids_by_source: Mapping[int, Sequence[int]],
    plan: Plan,
    schema: SampleSchema,
    num_sources: int,
) -> dict[int, Sample]:
    """Inverse of ``_pack`` on the receiving side; each field is copied out of the buffer (a
    uint8 slice may be misaligned for its dtype)."""
    samples: dict[int, Sample] = {}
    offset = 0
    for source in range(num_sources):
        for i in ids_by_source.get(source, ()):
            sample: Sample = {}
            for name, dtype in schema.fields:
                size = plan.seqlens[i] * dtype.itemsize
                sample[name] = buffer[offset : offset + size].clone().view(dtype)
                offset += size
            samples[i] = sample
    assert offset == buffer.numel(), "received bytes must match the routing table"
    return samples


# ---------------------------------------------------------------------------------------------
# 3. Routing
# ---------------------------------------------------------------------------------------------


def route_samples(
    plan: Plan,
    local_samples: Mapping[int, Sample],
    position: int,
    domain_group: Optional[ProcessGroup],
    owner_of: OwnerFn,
    *,
    schema: Optional[SampleSchema] = None,
    table: Optional[RoutingTable] = None,
) -> RoutedSamples:
    """Give this rank the samples of its CP groups with one all-to-all over the DP×CP domain.

    ``local_samples`` are the samples this rank's DP replica holds (global id -> fields; every CP
    rank of the replica holds the same ones); ``owner_of`` maps a sample id to its DP rank.
    Collective over ``domain_group``, whose group rank must equal ``position``. Without ``schema``
    the ranks agree on it with one small object all-gather (pass it to skip that); ``table``
    (from ``build_routing_table``) may be passed when it was computed ahead of time.
    """
    _check_position(plan, position, domain_group)
    table = table if table is not None else build_routing_table(plan, owner_of)
    schema = schema if schema is not None else agree_on_schema(local_samples, domain_group)
    _check_local_samples(plan, local_samples, position, owner_of, schema)
    device = _device_of(local_samples)
    send, send_splits = _pack(
        table.sends(position), local_samples, schema, plan.domain.size, device
    )
    incoming = table.receives(position)
    recv_splits = [
        _sample_bytes(schema, plan, incoming.get(s, ())) for s in range(plan.domain.size)
    ]
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=domain_group)
    received = _unpack(recv, incoming, plan, schema, plan.domain.size)
    kept = [i for i in table.needed[position] if i not in received]
    samples = {**received, **{i: local_samples[i] for i in kept}}
    return RoutedSamples(
        samples={i: samples[i] for i in sorted(samples)},
        bytes_received=recv.numel(),
        bytes_sent=send.numel(),
        bytes_local=_sample_bytes(schema, plan, kept),
    )


def route_by_lane_all_gather(
    plan: Plan,
    local_samples: Mapping[int, Sample],
    position: int,
    lane_group: Optional[ProcessGroup],
    owner_of: OwnerFn,
    *,
    schema: Optional[SampleSchema] = None,
) -> RoutedSamples:
    """Give this rank the samples of its CP groups with one all-gather inside its CP lane.

    The lane (``lane_positions``: megatron's DP group of this rank, group rank = DP rank) holds
    one copy of each DP replica's samples, so gathering over it brings the whole batch; this
    rank keeps the samples of its own groups and drops the rest. Each DP rank's samples travel
    as one buffer padded to the largest (gloo's all-gather needs equal sizes). It connects a
    rank only to its lane, over the collective connections the DP group already has, where the
    all-to-all connects it point to point to any rank of the domain (docs/scaling.md). Same
    arguments and result as ``route_samples``, with ``lane_group`` for ``domain_group``.
    """
    dp_rank = position // plan.domain.cp_size
    _check_lane(plan, position, lane_group)
    schema = schema if schema is not None else agree_on_schema(local_samples, lane_group)
    owners = [_checked_owner(owner_of, i, plan.domain.dp_size) for i in range(len(plan.seqlens))]
    ids_by_dp = {d: [i for i, o in enumerate(owners) if o == d] for d in range(plan.domain.dp_size)}
    _check_local_samples(plan, local_samples, position, owner_of, schema)
    largest = max(_sample_bytes(schema, plan, ids) for ids in ids_by_dp.values())
    own, _ = _pack({0: ids_by_dp[dp_rank]}, local_samples, schema, 1, _device_of(local_samples))
    rows = _gather_rows(own, largest, plan.domain.dp_size, lane_group)
    needed = set(needed_samples(plan)[position])
    samples: dict[int, Sample] = {}
    for d, row in enumerate(rows):
        if d != dp_rank and any(i in needed for i in ids_by_dp[d]):
            size = _sample_bytes(schema, plan, ids_by_dp[d])
            unpacked = _unpack(row[:size], {0: ids_by_dp[d]}, plan, schema, 1)
            samples.update({i: s for i, s in unpacked.items() if i in needed})
    kept = [i for i in sorted(needed) if owners[i] == dp_rank]
    samples.update({i: local_samples[i] for i in kept})
    others = largest * (plan.domain.dp_size - 1)
    return RoutedSamples(
        samples={i: samples[i] for i in sorted(samples)},
        bytes_received=others,
        bytes_sent=others,
        bytes_local=_sample_bytes(schema, plan, kept),
    )


def agree_on_schema(
    local_samples: Mapping[int, Sample], group: Optional[ProcessGroup]
) -> SampleSchema:
    """The sample schema, agreed over ``group``: ranks holding no samples learn it from peers,
    and ranks whose samples disagree all raise the same ValueError."""
    mine = SampleSchema.of(local_samples[min(local_samples)]) if local_samples else None
    offers: list[Optional[SampleSchema]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(offers, mine, group=group)
    schemas = {offer for offer in offers if offer is not None}
    if len(schemas) != 1:
        raise ValueError(
            f"samples must share one set of fields and dtypes across ranks; found {len(schemas)}: "
            f"{sorted(str(s.fields) for s in schemas)}"
        )
    return schemas.pop()


def _check_position(plan: Plan, position: int, domain_group: Optional[ProcessGroup]) -> None:
    size = dist.get_world_size(domain_group)
    if size != plan.domain.size:
        raise ValueError(
            f"the plan's domain has {plan.domain.size} positions but domain_group has {size} ranks"
        )
    if dist.get_rank(domain_group) != position:
        raise ValueError(
            f"position {position} differs from this rank's index {dist.get_rank(domain_group)} "
            f"in domain_group; positions are indices in the DP×CP group (dp_rank·cp_size+cp_rank)"
        )


def _gather_rows(
    own: Tensor, largest: int, lane_size: int, lane_group: Optional[ProcessGroup]
) -> list[Tensor]:
    """Every lane rank's buffer (``own`` padded to ``largest``), as views of one flat gather
    buffer: list-form ``all_gather`` on NCCL gathers into a flat buffer and copies out, twice
    the memory of the whole batch; ``all_gather_single`` (formerly ``all_gather_into_tensor``,
    on gloo sub-groups too) fills ours directly."""
    padded = torch.zeros(largest, dtype=torch.uint8, device=own.device)
    padded[: own.numel()] = own
    flat = torch.empty(largest * lane_size, dtype=torch.uint8, device=own.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, padded, group=lane_group)
    return list(flat.view(lane_size, largest))


def _check_lane(plan: Plan, position: int, lane_group: Optional[ProcessGroup]) -> None:
    size, rank = dist.get_world_size(lane_group), dist.get_rank(lane_group)
    dp_rank = position // plan.domain.cp_size
    if size != plan.domain.dp_size or rank != dp_rank:
        raise ValueError(
            f"lane_group has {size} ranks and this rank is its rank {rank}; the CP lane of "
            f"position {position} has {plan.domain.dp_size} ranks (one per DP replica) and this "
            f"rank is its rank {dp_rank}: pass megatron's DP group (same CP rank, every DP rank)"
        )


def _check_local_samples(
    plan: Plan,
    local_samples: Mapping[int, Sample],
    position: int,
    owner_of: OwnerFn,
    schema: SampleSchema,
) -> None:
    """The local samples must be exactly those ``owner_of`` gives this DP rank, well-formed."""
    dp_rank = position // plan.domain.cp_size
    owned = [i for i in range(len(plan.seqlens)) if owner_of(i) == dp_rank]
    if sorted(local_samples) != owned:
        raise ValueError(
            f"position {position} (DP rank {dp_rank}) holds samples {sorted(local_samples)}, but "
            f"owner_of assigns {owned} to DP rank {dp_rank}"
        )
    for i in owned:
        schema.check(i, local_samples[i], plan.seqlens[i])


def _device_of(local_samples: Mapping[int, Sample]) -> Device:
    for sample in local_samples.values():
        for tensor in sample.values():
            return tensor.device
    return "cpu"
