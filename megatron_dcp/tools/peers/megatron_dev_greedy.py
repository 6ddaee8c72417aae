"""Megatron-LM dev's greedy dynamic-CP scheduler as a peer in the simulator.

Re-implemented (in our own code) from ``DefaultDynamicCPScheduler`` of Megatron-LM's ``dev``
branch, checked against commit ``d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1`` (2026-08-21):
``get_groups_and_subsamples`` in ``megatron/core/datasets/data_schedule.py``, and
``next_hdp_group_packing_aware``, ``align_sample_id_groups`` and ``dcp_gpus_needed`` in
``megatron/core/datasets/data_schedule_utils.py``. ``main`` has no such scheduler. It goes:

1. the sequences are sorted longest first (ties in sample-id order) and micro-batches are built
   one at a time from the ones left;
2. a micro-batch opens with its longest sequence on ranks ``[0, c)``, ``c`` its minimum CP size
   (the smallest power of two ≥ ``L / budget``, at least ``min_cp_size``). Every other sequence,
   longest first, weighs every CP size ``c`` from its minimum up to N (doubling), and at each size
   first every existing group of exactly that size whose ranks keep ``Σ L / c ≤ budget`` (in the
   order the groups were opened), then a new group on the lowest-numbered ``c`` free ranks. Each
   option is scored by upstream's workload estimate, the largest per-rank ``Σ L² / c`` of the
   micro-batch once the sequence is in; the first option with the strictly lowest score wins (so
   a sequence joins the first group of its minimum size with room unless that raises the
   micro-batch's peak, and may take a *larger* CP size when that lowers the peak). Options above
   ``1.05 × L_longest × budget`` are refused (a cap that the token budget already implies). A
   sequence with no option waits for the next micro-batch;
3. groups sit side by side from rank 0 in the order they were opened. While ranks are left empty
   (a tail), the leftmost group of the smallest size is doubled (``min(2s, N)`` ranks) and the
   groups right of it move right; where no group can grow (only in a domain that is no power of
   two) the micro-batch is dropped and rebuilt as one group over the whole domain packing, longest
   first, every sequence that still fits its budget;
4. with VPP (``microbatch_group_size_per_vp_stage`` > 1) micro-batches are split until the count
   is a multiple of it: the last one first, then backwards (wrapping round); a micro-batch is cut
   at the first group boundary at or past rank ``N // 2``, each half moves to rank 0 and is filled
   by doubling the leftmost of its smallest groups (the left half is appended at the end, the right
   half takes the original's place); a micro-batch with a single group cannot be split.

Mapping to our :class:`~megatron_dcp.scheduling.plan.Plan`: the groups of a micro-batch become
CP groups over their ranks. Upstream lays groups side by side from rank 0; their sizes have come
out non-increasing (hence on aligned blocks) in every case we tried. Any other order would be laid
out again, largest group first (a cost-neutral permutation of ranks).

Where upstream fails the peer raises a ``ValueError`` (the simulator's "n/a"): an assertion, an
``IndexError`` when a push would run past the last rank, or a VPP refill that never ends (all of
them only possible on a domain that is no power of two), and a VPP count no split can reach.
Zero-length sequences take the minimum CP size (upstream's ``log2(0)`` would fail). Decisions use
upstream's ``L² / c`` estimate, never our cost model; the simulator scores the plan under the
same cost model as ours. It is not registered: the core never sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.domain import is_power_of_two
from megatron_dcp.scheduling.draft import Item, longest_first
from megatron_dcp.scheduling.plan import CPGroup, MicroBatch
from megatron_dcp.scheduling.registry import Scheduler

PEER_NAME = "megatron-dev greedy (peer)"

# Upstream's ``_DYNAMIC_CP_WORKLOAD_CAP_DELTA``: slack of the per-rank workload cap.
WORKLOAD_CAP_DELTA = 0.05


@dataclass(eq=False)
class Group:
    """One CP group of a micro-batch under construction; its ranks follow from its place in the
    row (groups sit side by side from rank 0)."""

    size: int
    items: List[Item] = field(default_factory=list)
    tokens: int = 0
    work: float = 0.0  # per-rank Σ L² / c, upstream's workload estimate

    def add(self, item: Item) -> None:
        self.items.append(item)
        self.tokens += item.seqlen
        self.work += workload(item.seqlen, self.size)


Row = List[Group]


class DevGreedyPeer(Scheduler):
    """The peer; built like any scheduler (``DevGreedyPeer(dp_size=..., ...)``)."""

    name = PEER_NAME

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        pool = longest_first([Item(i, n, self.min_cp(n)) for i, n in enumerate(seqlens)])
        rows: List[Row] = []
        while pool:
            row, pool = self.fill_row(pool)
            rows.append(row)
        k = self.microbatch_group_size_per_vp_stage
        if k is not None and k > 1:
            self.split_for_vpp(rows, k)
        return [self.freeze(row) for row in rows]

    # -- step 2: one micro-batch ------------------------------------------------------------------

    def min_cp(self, seqlen: int) -> int:
        """Upstream's ``dcp_gpus_needed``: the smallest power of two ≥ ``L / budget``, at least
        ``min_cp_size``; never the whole domain when it is no power of two."""
        size = 1
        while size * self.domain.budget < seqlen:
            size *= 2
        return max(size, self.domain.min_cp_size)

    def fill_row(self, pool: Sequence[Item]) -> Tuple[Row, List[Item]]:
        """Steps 2 and 3 for one micro-batch: (its groups, left to right; the sequences left over).
        ``pool`` is longest first."""
        n, budget = self.domain.size, self.domain.budget
        first = pool[0]
        if first.min_cp > n:
            raise ValueError(
                f"{PEER_NAME}: sample {first.sample_id} ({first.seqlen} tokens) needs CP size "
                f"{first.min_cp} but the domain has only {n} ranks (upstream asserts here)"
            )
        cap = float(first.seqlen) * float(budget) * (1.0 + WORKLOAD_CAP_DELTA)
        row: Row = [Group(first.min_cp)]
        row[0].add(first)
        leftovers = []
        for item in pool[1:]:
            choice = self.best_option(item, row, cap)
            if choice is None:
                leftovers.append(item)
                continue
            size, group = choice
            if group is None:
                group = Group(size)
                row.append(group)
            group.add(item)
        if not self.fill_empty_ranks(row):
            return self.whole_domain_row(pool)
        return row, leftovers

    def best_option(
        self, item: Item, row: Row, cap: float
    ) -> Optional[Tuple[int, Optional[Group]]]:
        """(CP size, group to join or None for a new one) with the lowest projected peak workload;
        the first such option in upstream's order; None when no option is allowed."""
        n, budget = self.domain.size, self.domain.budget
        peak = max(group.work for group in row)
        free = n - sum(group.size for group in row)
        best: Optional[Tuple[float, int, Optional[Group]]] = None
        size = item.min_cp
        while size <= n:
            work = workload(item.seqlen, size)
            options = [g for g in row if g.size == size and g.tokens + item.seqlen <= size * budget]
            scored = [(max(peak, g.work + work), g) for g in options]
            if free >= size:
                scored.append((max(peak, work), None))
            for projected, group in scored:
                if projected <= cap and (best is None or projected < best[0]):
                    best = (projected, size, group)
            size *= 2
        return None if best is None else (best[1], best[2])

    # -- step 3: empty ranks ----------------------------------------------------------------------

    def fill_empty_ranks(self, row: Row) -> bool:
        """Double the leftmost group of the smallest size until no rank is empty. False when no
        group can grow (upstream then falls back to one whole-domain group)."""
        n = self.domain.size
        while True:
            free = n - sum(group.size for group in row)
            if not free:
                return True
            smallest = min(group.size for group in row)
            grown = min(2 * smallest, n)
            need = grown - smallest
            end = -1  # last rank of the group being looked at
            for index, group in enumerate(row):
                end += group.size
                if group.size != smallest or end + need >= n:
                    continue
                if index < len(row) - 1 and need > free:
                    raise ValueError(
                        f"{PEER_NAME}: growing a group of {smallest} ranks to {grown} would push "
                        f"the groups right of it past the last rank (upstream fails here)"
                    )
                group.size = grown
                break
            else:
                return False

    def whole_domain_row(self, pool: Sequence[Item]) -> Tuple[Row, List[Item]]:
        """Upstream's fallback: one group over the whole domain packing, longest first, every
        sequence of ``pool`` that still fits the budget."""
        group, leftovers = Group(self.domain.size), []
        for item in pool:
            if group.tokens + item.seqlen <= self.domain.size * self.domain.budget:
                group.add(item)
            else:
                leftovers.append(item)
        return [group], leftovers

    # -- step 4: VPP ------------------------------------------------------------------------------

    def split_for_vpp(self, rows: List[Row], k: int) -> None:
        """Split micro-batches, the last one first and then backwards (wrapping round), until
        their count is a multiple of ``k``."""
        remainder = -len(rows) % k
        index, failed = len(rows) - 1, 0
        while remainder:
            if index < 0:
                if failed >= len(rows):
                    raise ValueError(
                        f"{PEER_NAME}: cannot reach a multiple of {k} micro-batches: no "
                        "micro-batch has more than one CP group to split (upstream asserts)"
                    )
                index = len(rows) - 1
            halves = self.split_row(rows[index])
            if halves is None:
                failed += 1
            else:
                rows[index], left = halves
                rows.append(left)
                remainder -= 1
                failed = 0
            index -= 1

    def split_row(self, row: Row) -> Optional[Tuple[Row, Row]]:
        """(right half, left half) of a micro-batch cut at the first group boundary at or past
        rank N // 2, each refilled; None for a micro-batch of one group."""
        if len(row) == 1:
            return None
        sizes = [group.size for group in row]
        if any(later > earlier for earlier, later in zip(sizes, sizes[1:])):
            raise ValueError(f"{PEER_NAME}: CP sizes {sizes} not decreasing (upstream asserts)")
        cut, covered = 0, 0
        while covered < self.domain.size // 2:
            covered += sizes[cut]
            cut += 1
        left, right = row[:cut], row[cut:]
        return self.refill_half(right), self.refill_half(left)

    def refill_half(self, row: Row) -> Row:
        """Upstream's refill of a split half: while ranks are empty, scan the groups right to
        left; at the first size increase, double the group right of it; if none and the leftmost
        group fits in the empty ranks, double the leftmost group."""
        n = self.domain.size
        while True:
            free = n - sum(group.size for group in row)
            if not free:
                return row
            previous = 0
            for index in range(len(row) - 1, -1, -1):
                size = row[index].size
                if previous and size > previous:
                    target = row[index + 1]
                    break
                if index == 0 and size <= free:
                    target = row[0]
                    break
                previous = size
            else:
                raise ValueError(
                    f"{PEER_NAME}: the empty ranks of a split micro-batch cannot be filled "
                    "(upstream loops forever here)"
                )
            if target.size > free:
                raise ValueError(
                    f"{PEER_NAME}: doubling a group of {target.size} ranks in a split micro-batch "
                    f"with {free} empty ranks (upstream corrupts the micro-batch here)"
                )
            target.size *= 2

    # -- the plan ---------------------------------------------------------------------------------

    def freeze(self, row: Row) -> MicroBatch:
        """The micro-batch: groups side by side from rank 0, largest first where upstream's order
        would leave a group off its aligned block (a cost-neutral permutation of ranks)."""
        ordered = row
        start = 0
        for group in row:
            if group.size != self.domain.size and (
                not is_power_of_two(group.size) or start % group.size
            ):
                ordered = sorted(row, key=lambda g: -g.size)
                break
            start += group.size
        groups, start = [], 0
        for group in ordered:
            ranks = tuple(range(start, start + group.size))
            groups.append(CPGroup(ranks, tuple(item.sample_id for item in group.items)))
            start += group.size
        return MicroBatch(tuple(groups))


def workload(seqlen: int, cp_size: int) -> float:
    """Upstream's per-rank workload estimate of one sequence: ``L² / c``."""
    return (seqlen * seqlen) / cp_size
