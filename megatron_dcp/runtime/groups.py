"""The DCP process-group registry: one communicator per CP group that a plan may use.

A plan assigns every position of the DP×CP domain to an aligned block of positions (a CP group)
per micro-batch; the model then runs that micro-batch's attention over the block's process group.
``DCPGroups.create`` builds them once, after the model-parallel groups exist. The block set is the
scheduling layer's (``Domain.group_sizes`` / ``Domain.is_group_block``), so plans and
communicators cannot disagree.

Members-only creation: a rank calls ``new_group(..., use_local_synchronization=True)`` only for
the blocks it belongs to (``communicator_budget``: about log2(N / min_cp_size) calls instead of
about N per domain). torch names such a group by its ranks *and* the number of process groups the
caller holds at that moment, so the members of a block must hold equally many when they create
it: the registry creates the largest blocks first (every member of a block then has created the
same larger blocks before it, also when N is not a power of two) and checks, in the one
all-reduce it makes anyway, that the members held equally many groups before. When that check
fails, when a name would repeat that of a group this process created and destroyed before (its
stale rendezvous keys in the store hang the new group), or when the default group is bound to a
device (torch then splits the default NCCL communicator, a call every rank must join), every rank
creates every block, as torch's default ``new_group`` requires (same order everywhere).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as _c10d

from megatron_dcp.scheduling import Block, CPGroup, Domain

RankTuple = tuple[int, ...]
_LOG = logging.getLogger(__name__)
# (ranks, groups held by the caller) of every members-only group made in this process: its name.
_MEMBERS_ONLY_MADE: set[tuple[RankTuple, int]] = set()


@dataclass(frozen=True)
class CommunicatorCount:
    """How many communicators this rank holds for DCP: created by the registry vs reused."""

    created: int
    reused: int

    @property
    def total(self) -> int:
        return self.created + self.reused


@dataclass(frozen=True)
class _Entry:
    """This rank's group of one size: its global ranks, the communicator, and who owns it."""

    ranks: RankTuple
    group: Optional[ProcessGroup]
    created: bool


class DCPGroups:
    """This rank's CP process groups, one per group size, for the blocks of its DP×CP domain.

    Built with :meth:`create`; the process groups are passed explicitly to the code that needs
    them (``group``/``group_for``), never stored in module globals.
    """

    def __init__(self, domain: Domain, domain_ranks: RankTuple, entries: Mapping[int, _Entry]):
        self._domain = domain
        self._domain_ranks = domain_ranks
        self._position = domain_ranks.index(dist.get_rank())
        self._entries = dict(entries)
        self._destroyed = False

    @classmethod
    def create(
        cls,
        domain_rank_lists: Sequence[Sequence[int]],
        min_cp_size: int,
        *,
        reuse: Mapping[RankTuple, ProcessGroup] = MappingProxyType({}),
        backend: Optional[str] = None,
    ) -> "DCPGroups":
        """Create the groups of every domain of the job; collective over the whole world.

        ``domain_rank_lists`` holds every DP×CP rank list of the job (global ranks, each sorted;
        a rank's position is its index in its list). ``reuse`` maps rank tuples to existing
        groups (e.g. megatron's DP×CP and CP groups); a block is reused only when every one of its
        members offers a group for it. One all-reduce over the world agrees on the reuse and on
        members-only creation (module docstring), then each rank creates only its own blocks.
        """
        lists = _check_domain_lists(domain_rank_lists, dist.get_rank(), dist.get_world_size())
        domain = _domain_of(len(lists[0]), min_cp_size)
        candidates = [
            tuple(ranks[p] for p in block.positions)
            for block in group_blocks(domain)
            for ranks in lists
        ]
        offered = _offered_groups(reuse)
        reused, members_only = _agree_on_reuse(candidates, offered, backend)
        entries = _build_entries(candidates, reused, offered, backend, members_only)
        if 1 in domain.group_sizes:
            entries[1] = _Entry((dist.get_rank(),), None, False)
        mine = next(ranks for ranks in lists if dist.get_rank() in ranks)
        return cls(domain, mine, entries)

    @property
    def position(self) -> int:
        """This rank's index in its DP×CP domain (dp_rank · cp_size + cp_rank in megatron)."""
        return self._position

    @property
    def domain_size(self) -> int:
        return self._domain.size

    @property
    def domain_ranks(self) -> RankTuple:
        """Global ranks of this rank's domain, indexed by position."""
        return self._domain_ranks

    @property
    def sizes(self) -> tuple[int, ...]:
        """Group sizes that exist (ascending), the same as the plan's ``Domain.group_sizes``."""
        return self._domain.group_sizes

    def group(self, size: int, position: Optional[int] = None) -> Optional[ProcessGroup]:
        """The process group of the block of ``size`` holding ``position`` (default: this rank's).

        None for size 1 (no communication). ``position``, when given, must lie in this rank's
        block: a rank holds no communicator for blocks it is not part of.
        """
        return self._entry(size, position).group

    def ranks(self, size: int, position: Optional[int] = None) -> RankTuple:
        """Global ranks of the block of ``size`` holding ``position`` (default: this rank's)."""
        return self._entry(size, position).ranks

    def group_for(self, cp_group: CPGroup) -> Optional[ProcessGroup]:
        """The process group of a plan's CP group (whose ``ranks`` are positions)."""
        block = Block(cp_group.ranks[0], len(cp_group.ranks))
        if cp_group.ranks != block.positions or not self._domain.is_group_block(block):
            raise ValueError(
                f"CP group over positions {cp_group.ranks} is not an aligned block of a size in "
                f"{self.sizes} of a domain of {self.domain_size}; was the plan made for this domain"
                f" and min_cp_size={self._domain.min_cp_size}?"
            )
        return self.group(block.size, block.start)

    def communicator_count(self) -> CommunicatorCount:
        """Communicators this rank holds for DCP (size 1 holds none)."""
        held = [entry for entry in self._entries.values() if entry.group is not None]
        created = sum(entry.created for entry in held)
        return CommunicatorCount(created=created, reused=len(held) - created)

    def report(self) -> str:
        """One line for the start-up log."""
        count = self.communicator_count()
        sizes = "/".join(str(size) for size in self.sizes)
        return (
            f"DCP groups: rank {dist.get_rank()} at position {self.position} of a domain of "
            f"{self.domain_size} ranks {list(self._domain_ranks)}; sizes {sizes}; communicators "
            f"{count.created} created + {count.reused} reused"
        )

    def destroy(self) -> None:
        """Destroy the communicators this registry created (not the reused ones). Idempotent."""
        if self._destroyed:
            return
        self._destroyed = True
        for entry in self._entries.values():
            if entry.created and entry.group is not None:
                dist.destroy_process_group(entry.group)

    def _entry(self, size: int, position: Optional[int]) -> _Entry:
        if self._destroyed:
            raise RuntimeError("DCPGroups.destroy() was called: its process groups are gone")
        if size not in self.sizes:
            raise ValueError(
                f"no DCP group of size {size}: sizes are {self.sizes} (domain of "
                f"{self.domain_size}, min_cp_size={self._domain.min_cp_size})"
            )
        if size not in self._entries:
            raise ValueError(
                f"position {self.position} is in no aligned block of size {size}: in a domain of "
                f"{self.domain_size} such blocks end at position {self.domain_size // size * size}"
            )
        if position is not None and not self._same_block(size, position):
            raise ValueError(
                f"position {position} is not in this rank's block of size {size} (this rank is at "
                f"position {self.position}); a rank holds only the groups it belongs to"
            )
        return self._entries[size]

    def _same_block(self, size: int, position: int) -> bool:
        if not 0 <= position < self.domain_size:
            raise ValueError(f"position {position} is outside the domain of {self.domain_size}")
        return size == self.domain_size or position // size == self.position // size


def group_blocks(domain: Domain) -> list[Block]:
    """Blocks with a communicator (size ≥ 2), by size then start: the scheduling layer's set."""
    return [block for size in domain.group_sizes if size > 1 for block in domain.blocks(size)]


class CommunicatorBudget(NamedTuple):
    """DCP communicator figures of one rank of a DP×CP domain (``communicator_budget``)."""

    joined: int  # groups of size >= 2 holding the rank: the communicators it holds
    new_group_calls: int  # new_group calls on the rank with members-only creation (= joined)
    blocks: int  # groups of size >= 2 in the domain: calls per rank per domain when all create all


def communicator_budget(
    domain_size: int, min_cp_size: int, position: Optional[int] = None
) -> CommunicatorBudget:
    """Communicators a rank of a DP×CP domain of N = ``domain_size`` ranks joins; calls it makes.

    Sizes S = {m, 2m, 4m, ... ≤ N} ∪ {N} with m = ``min_cp_size`` (a power of two ≤ N); size 1
    needs no communicator. The aligned blocks of size s are [k·s, (k+1)·s) for (k+1)·s ≤ N, and the
    whole domain. ``joined`` counts the sizes s ≥ 2 whose block holding ``position`` exists:

    - ``position`` None: the maximum over positions (position 0 lies in a block of every size),
      ``⌊log2(N/m)⌋ + 1 + [N is not a power of two] − [m = 1]``; N = 4,096, m = 1: 12.
    - a position p: sizes s ≥ 2 with s = N or (⌊p/s⌋ + 1)·s ≤ N (fewer near the end of a domain
      whose N is not a power of two: positions 4, 5 of N = 6 have no block of 4).

    ``new_group_calls`` = ``joined``: members-only creation calls ``new_group`` once per joined
    group (one fewer per group reused from megatron, e.g. its DP×CP and static CP groups).
    ``blocks`` = Σ over sizes s ≥ 2 below N of ⌊N/s⌋, plus 1 for the whole domain; for N a power
    of two, N − 1 when m ≤ 2 and 2N/m − 1 otherwise: the ``new_group`` calls every rank makes
    per domain of the job when every rank creates every group (torch's default).
    """
    if min_cp_size < 1 or min_cp_size & (min_cp_size - 1) or min_cp_size > domain_size:
        raise ValueError(f"min_cp_size={min_cp_size} is not a power of two in [1, {domain_size}]")
    powers = {min_cp_size << k for k in range((domain_size // min_cp_size).bit_length())}
    sizes = [s for s in powers | {domain_size} if s >= 2]
    position = 0 if position is None else position
    if not 0 <= position < domain_size:
        raise ValueError(f"position {position} is outside a domain of {domain_size}")
    joined = sum(1 for s in sizes if s == domain_size or (position // s + 1) * s <= domain_size)
    blocks = sum(domain_size // s if s < domain_size else 1 for s in sizes)
    return CommunicatorBudget(joined=joined, new_group_calls=joined, blocks=blocks)


def domain_rank_lists_from(group: Optional[ProcessGroup]) -> list[list[int]]:
    """Every DP×CP rank list of the job, learnt from each rank's ``group`` (e.g. megatron's DP×CP
    group): an int all-gather over the world, deduplicated, sorted. Collective over the world."""
    world = dist.get_world_size()
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(world))
    row = torch.full((world,), -1, dtype=torch.int64)
    row[: len(ranks)] = torch.tensor(ranks, dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    unique = {tuple(r for r in gathered.tolist() if r >= 0) for gathered in rows}
    return [list(ranks) for ranks in sorted(unique)]


def _domain_of(size: int, min_cp_size: int) -> Domain:
    """A scheduling Domain of ``size`` positions, for its group set (the budget plays no part)."""
    return Domain(dp_size=size, cp_size=1, max_seqlen_per_dp_cp_rank=1, min_cp_size=min_cp_size)


def _check_domain_lists(
    domain_rank_lists: Sequence[Sequence[int]], rank: int, world_size: int
) -> list[RankTuple]:
    """Sorted, validated rank lists: equal sizes, each ascending, disjoint, within the world,
    one of them holding this rank."""
    lists = sorted(tuple(int(r) for r in ranks) for ranks in domain_rank_lists)
    if not lists or not lists[0]:
        raise ValueError("domain_rank_lists is empty: pass every DP×CP rank list of the job")
    for ranks in lists:
        if len(ranks) != len(lists[0]) or list(ranks) != sorted(set(ranks)):
            raise ValueError(
                f"domain rank list {list(ranks)}: every DP×CP rank list must be strictly ascending "
                f"and of the same size ({len(lists[0])}); got {[list(r) for r in lists]}"
            )
        if ranks[0] < 0 or ranks[-1] >= world_size:
            raise ValueError(f"domain rank list {list(ranks)} is outside world size {world_size}")
    flat = [r for ranks in lists for r in ranks]
    if len(flat) != len(set(flat)):
        raise ValueError(f"domain rank lists overlap: {[list(r) for r in lists]}")
    if rank not in flat:
        raise ValueError(f"rank {rank} is in none of the domain rank lists {lists}")
    return lists


def _offered_groups(reuse: Mapping[RankTuple, ProcessGroup]) -> dict[RankTuple, ProcessGroup]:
    """``reuse`` with keys as sorted int tuples, each checked against its group's real ranks."""
    offered = {tuple(sorted(int(r) for r in key)): group for key, group in reuse.items()}
    for key, group in offered.items():
        _check_offer(key, group)
    return offered


def _agree_on_reuse(
    candidates: Sequence[RankTuple],
    offered: Mapping[RankTuple, ProcessGroup],
    backend: Optional[str],
) -> tuple[set[RankTuple], bool]:
    """Candidates every member offers a group for, and whether members-only creation is safe: one
    all-reduce over the world of the offer counts and of every rank's ``_local_sync_token``.

    Non-members cannot see a rank's ``reuse`` mapping, yet the old path makes them skip
    ``new_group`` for a reused block exactly when its members do; counting the offers makes the
    choice global, and so is the choice of path (every rank sees every token).
    """
    world = dist.get_world_size()
    vector = torch.zeros(len(candidates) + world, dtype=torch.int64)
    vector[: len(candidates)] = torch.tensor([int(c in offered) for c in candidates])
    mine = [c for c in candidates if dist.get_rank() in c]
    vector[len(candidates) + dist.get_rank()] = _local_sync_token(backend, mine)
    dist.all_reduce(vector)
    counts, tokens = vector[: len(candidates)].tolist(), vector[len(candidates) :].tolist()
    reused = {c for c, n in zip(candidates, counts) if n == len(c)}
    members_only = all(
        tokens[c[0]] > 0 and all(tokens[r] == tokens[c[0]] for r in c)
        for c in candidates
        if c not in reused
    )
    if not members_only and dist.get_rank() == 0:
        _LOG.warning(
            "DCP groups: every rank creates every group (%d calls per rank): members-only "
            "creation needs an unbound default group and equal group counts within each block",
            len(candidates) - len(reused),
        )
    return reused, members_only


def _groups_held() -> Optional[int]:
    """Process groups this rank holds (torch's registry), None where torch has no such registry."""
    names = getattr(getattr(_c10d, "_world", None), "pg_names", None)
    return None if names is None else len(names)


def _local_sync_token(backend: Optional[str], mine: Sequence[RankTuple]) -> int:
    """1 + the number of process groups this rank holds (torch names a members-only group after
    its ranks and that number), or 0 when this rank cannot create its blocks ``mine`` members-only:
    a default group bound to a device (new_group then splits its communicator, with every rank),
    MPI, a torch without the registry this relies on, or a name this process used before."""
    held = _groups_held()
    bound = getattr(dist.group.WORLD, "bound_device_id", None) is not None
    mpi = "mpi" in str(backend or dist.get_backend()).lower()
    if held is None or bound or mpi or getattr(_c10d, "_use_torchcomms_enabled", bool)():
        return 0
    names = [(ranks, n) for ranks in mine for n in range(held, held + len(mine))]
    return 0 if any(name in _MEMBERS_ONLY_MADE for name in names) else held + 1


def _check_offer(key: RankTuple, group: ProcessGroup) -> None:
    """A reuse entry must name this rank's group by exactly its global ranks."""
    actual = tuple(sorted(dist.get_process_group_ranks(group)))
    if actual != key:
        raise ValueError(f"reuse[{key}] is a process group over ranks {actual}, not {key}")
    if dist.get_rank() not in key:
        raise ValueError(f"reuse[{key}]: rank {dist.get_rank()} is not a member of that group")


def _build_entries(
    candidates: Sequence[RankTuple],
    reused: set[RankTuple],
    reuse: Mapping[RankTuple, ProcessGroup],
    backend: Optional[str],
    members_only: bool,
) -> dict[int, _Entry]:
    """Create (or reuse) the groups; keep this rank's. Members only: the blocks holding this rank,
    largest first, then by start (module docstring: why); else every candidate in order."""
    rank = dist.get_rank()
    if members_only:
        candidates = sorted((c for c in candidates if rank in c), key=lambda c: (-len(c), c[0]))
    entries: dict[int, _Entry] = {}
    for ranks in candidates:
        if ranks in reused:
            group, created = (reuse.get(ranks), False)
        else:
            if members_only:
                _MEMBERS_ONLY_MADE.add((ranks, _groups_held() or 0))
            desc = f"DCP_CP_{len(ranks)}_{ranks[0]}"
            group = dist.new_group(
                list(ranks),
                backend=backend,
                timeout=default_group_timeout(),
                group_desc=desc,
                use_local_synchronization=members_only,
            )
            created = True
        if rank in ranks:
            assert len(ranks) not in entries, "a rank is in one block per size"
            entries[len(ranks)] = _Entry(ranks, group, created)
    return entries


def default_group_timeout() -> Optional[timedelta]:
    """The collective timeout of the default process group (megatron sets it from
    ``--distributed-timeout-minutes``), for the groups DCP creates: torch would give them its own
    default (30 minutes on gloo), so a rank whose peer died would wait that long. None where the
    backend does not expose it (then torch's default applies)."""
    group = _c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
