"""Plan types: frozen dataclasses describing the schedule of one global batch, and their invariants."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Dict, Optional, Set, Tuple

from megatron_dcp.scheduling.domain import Block, Domain

DIGEST_BITS = 63  # digests are non-negative int64 values (a min/max all-reduce negates them)
RANKS = attrgetter("ranks")
SAMPLE_IDS = attrgetter("sample_ids")


class InvalidPlanError(ValueError):
    """A plan violates one of the plan invariants (docs/architecture.md, "Plan invariants")."""


@dataclass(frozen=True)
class CPGroup:
    """One CP group of a micro-batch: the positions it spans and the samples it packs, in order."""

    ranks: Tuple[int, ...]
    sample_ids: Tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def block(self) -> Block:
        return Block(self.ranks[0], len(self.ranks))

    def tokens_per_rank(self, seqlens: Tuple[int, ...]) -> float:
        return sum(seqlens[i] for i in self.sample_ids) / self.size


@dataclass(frozen=True)
class MicroBatch:
    """One slot of the plan; its CP groups partition the domain."""

    groups: Tuple[CPGroup, ...]

    def group_of(self, position: int) -> CPGroup:
        for group in self.groups:
            if group.ranks[0] <= position <= group.ranks[-1]:
                return group
        raise KeyError(position)

    @property
    def sample_ids(self) -> Tuple[int, ...]:
        return tuple(i for group in self.groups for i in group.sample_ids)


@dataclass(frozen=True)
class Plan:
    """The schedule of one global batch: micro-batches over a domain for the given lengths."""

    seqlens: Tuple[int, ...]
    domain: Domain
    microbatches: Tuple[MicroBatch, ...]
    microbatch_group_size_per_vp_stage: Optional[int] = None
    # The most samples one CP group of a micro-batch may hold (None: no cap).
    max_samples_per_group: Optional[int] = None
    # Each sample's vision-encoder patches (a VLM's images; empty: none): the cost model's
    # ``vision`` term prices them. ``Scheduler.schedule`` stores none when every count is 0.
    patches: Tuple[int, ...] = ()

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def cp_size_histogram(self) -> Dict[int, int]:
        """Number of samples run at each CP size."""
        counts = Counter(
            g.size for mb in self.microbatches for g in mb.groups for _ in g.sample_ids
        )
        return dict(sorted(counts.items()))

    def digest(self) -> int:
        """A 63-bit digest of the plan (lengths, micro-batches, VPP group size, and the patches
        when there are any: a plan without them keeps its digest): equal on every rank that
        holds the same plan, whatever the process (no salted ``hash``)."""
        values = array("q", self.seqlens)
        values.append(self.microbatch_group_size_per_vp_stage or 0)
        for microbatch in self.microbatches:  # the ids name the lengths: hashed once above
            _append_microbatch(values, microbatch)
        if self.patches:
            values.append(-len(self.patches))  # no micro-batch encoding holds a negative value
            values.extend(self.patches)
        return _digest(values)

    def microbatch_digests(self) -> Tuple[int, ...]:
        """One 63-bit digest per micro-batch: its groups, their samples and the samples' lengths."""
        return tuple(
            _digest(_append_microbatch(array("q"), mb, self.seqlens)) for mb in self.microbatches
        )

    def validate(self) -> "Plan":
        """Raise :class:`InvalidPlanError` on any violated invariant; return ``self`` otherwise."""
        self._check_coverage()
        self._check_patches()
        blocks: Set[Tuple[int, ...]] = set()  # the rank tuples already seen to be group blocks
        for index, microbatch in enumerate(self.microbatches):
            self._check_microbatch(index, microbatch, blocks)
        self._check_vpp_alignment()
        return self

    def _check_coverage(self) -> None:
        groups = chain.from_iterable(mb.groups for mb in self.microbatches)
        ids = list(chain.from_iterable(map(SAMPLE_IDS, groups)))
        if sorted(ids) == list(range(len(self.seqlens))):
            return
        seen, expected = Counter(ids), Counter(range(len(self.seqlens)))
        if seen != expected:
            missing = sorted(expected - seen)[:5]
            extra = sorted(seen - expected)[:5]
            raise InvalidPlanError(
                f"every sample must appear exactly once: missing {missing}, extra/duplicated {extra}"
            )

    def _check_patches(self) -> None:
        """``patches`` is empty or one non-negative count per sample."""
        if not self.patches:
            return
        if len(self.patches) != len(self.seqlens):
            raise InvalidPlanError(
                f"patches holds {len(self.patches)} counts for {len(self.seqlens)} samples"
            )
        if min(self.patches) < 0:
            raise InvalidPlanError(f"patches must be non-negative, got {min(self.patches)}")

    def _check_microbatch(
        self, index: int, microbatch: MicroBatch, blocks: Set[Tuple[int, ...]]
    ) -> None:
        covered = sorted(chain.from_iterable(map(RANKS, microbatch.groups)))
        if covered != list(range(self.domain.size)):
            raise InvalidPlanError(f"micro-batch {index}: groups do not partition the domain")
        seqlens, budget = self.seqlens, self.domain.budget
        for group in microbatch.groups:
            ranks, ids = group.ranks, group.sample_ids
            if ranks not in blocks:
                block = Block(ranks[0], len(ranks))
                if ranks != block.positions or not self.domain.is_group_block(block):
                    raise self._group_error(index, group, "not an aligned block with a CP group")
                blocks.add(ranks)
            if not ids:
                raise self._group_error(index, group, "ranks are idle (no samples)")
            cap = self.max_samples_per_group
            if cap is not None and len(ids) > cap:
                raise self._group_error(index, group, f"{len(ids)} samples exceed the cap {cap}")
            if sum(map(seqlens.__getitem__, ids)) > budget * len(ranks):
                tokens = group.tokens_per_rank(seqlens)
                raise self._group_error(
                    index, group, f"{tokens:.1f} tokens per rank exceed the budget {budget}"
                )

    @staticmethod
    def _group_error(index: int, group: CPGroup, what: str) -> InvalidPlanError:
        return InvalidPlanError(
            f"micro-batch {index}, group {group.ranks[0]}..{group.ranks[-1]}: {what}"
        )

    def _check_vpp_alignment(self) -> None:
        k = self.microbatch_group_size_per_vp_stage
        if k and self.num_microbatches % k:
            raise InvalidPlanError(
                f"{self.num_microbatches} micro-batches is not a multiple of "
                f"microbatch_group_size_per_vp_stage={k}"
            )


def _append_microbatch(
    values: array, microbatch: MicroBatch, seqlens: Optional[Tuple[int, ...]] = None
) -> array:
    """Append ``microbatch`` to ``values`` decodably: the group count G, the G group sizes, their
    sample counts, their sample ids and, given ``seqlens``, those samples' lengths (groups are
    in position order and partition the domain, so the sizes fix where each starts)."""
    groups = microbatch.groups
    values.append(len(groups))
    values.extend(map(len, map(RANKS, groups)))
    values.extend(map(len, map(SAMPLE_IDS, groups)))
    values.extend(chain.from_iterable(map(SAMPLE_IDS, groups)))
    if seqlens is not None:
        values.extend(map(seqlens.__getitem__, chain.from_iterable(map(SAMPLE_IDS, groups))))
    return values


def _digest(values: array) -> int:
    """63 bits of BLAKE2b over ``values``' bytes."""
    raw = hashlib.blake2b(values.tobytes(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> (64 - DIGEST_BITS)
