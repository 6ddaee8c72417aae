"""Megatron-LM dev's greedy dynamic-CP scheduler as a peer in the simulator.

Written from the published description of the algorithm (no upstream code):

1. each micro-batch is built greedily from the remaining sequences, longest first;
2. each sequence takes the smallest CP size whose per-rank share fits the budget, on the first
   aligned block of that size that is free or already holds a group of that size with room for
   it (sequences of one group are packed as THD); a sequence that fits nowhere waits for the next
   micro-batch;
3. ranks left empty are filled by doubling the group next to them (its buddy block); where the
   buddy block holds several smaller groups, they merge into one group on the parent block;
4. with VPP, the micro-batch holding the most sequences is split in two until the count is a
   multiple of the VPP micro-batch group size.

It produces a :class:`~megatron_dcp.scheduling.plan.Plan` (validated like ours) and is scored
under the same cost model. It is not registered: the core never sees it, and it needs a
power-of-two DP×CP domain (as the upstream one does).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.domain import Block, is_power_of_two
from megatron_dcp.scheduling.draft import GroupDraft, Item, freeze_microbatch
from megatron_dcp.scheduling.plan import MicroBatch
from megatron_dcp.scheduling.registry import Scheduler

PEER_NAME = "megatron-dev greedy (peer)"

Row = List[GroupDraft]


class DevGreedyPeer(Scheduler):
    """The peer; built like any scheduler (``DevGreedyPeer(dp_size=..., ...)``)."""

    name = PEER_NAME

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not is_power_of_two(self.domain.size):
            raise ValueError(
                f"{PEER_NAME} needs a power-of-two DP×CP domain, got {self.domain.size} ranks"
            )

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        pool = longest_first([Item(i, n, self.domain.cp_degree(n)) for i, n in enumerate(seqlens)])
        rows: List[Row] = []
        while pool:
            row, pool = self.fill_row(pool)
            rows.append(row)
        self.split_for_vpp(rows)
        return [freeze_microbatch(row) for row in rows]

    def fill_row(self, pool: Sequence[Item]) -> Tuple[Row, List[Item]]:
        """Steps 2 and 3 for one micro-batch: (its groups, the sequences left over)."""
        owners: List[Optional[GroupDraft]] = [None] * self.domain.size
        row: Row = []
        leftovers = []
        for item in pool:
            group = self.place(item, owners, row)
            if group is None:
                leftovers.append(item)
            else:
                group.add(item, self.cost_model)
        self.fill_empty_ranks(owners, row)
        return row, leftovers

    def place(
        self, item: Item, owners: List[Optional[GroupDraft]], row: Row
    ) -> Optional[GroupDraft]:
        """The first aligned block of the item's CP size that is free or has room for it."""
        size, budget = item.min_cp, self.domain.budget
        for start in range(0, self.domain.size, size):
            owner = owners[start]
            if owner is not None and owner.block == Block(start, size):
                if owner.fits(item, budget):
                    return owner
            elif owner is None and not any(owners[start : start + size]):
                return claim(GroupDraft.over(Block(start, size), self.cost_model), owners, row)
        return None

    def fill_empty_ranks(self, owners: List[Optional[GroupDraft]], row: Row) -> None:
        """Step 3: double the group next to each empty block (smallest blocks first)."""
        size = 1
        while None in owners and size < self.domain.size:
            for start in range(0, self.domain.size, size):
                block = Block(start, size)
                if is_free(block, owners) and not is_free(buddy(block), owners):
                    self.absorb(block, owners, row)
            size *= 2

    def absorb(self, free: Block, owners: List[Optional[GroupDraft]], row: Row) -> None:
        """Grow the group(s) of ``free``'s buddy block over the parent block."""
        parent = Block(min(free.start, buddy(free).start), 2 * free.size)
        inside = [g for g in row if parent.start <= g.block.start < parent.stop]
        merged = GroupDraft.over(parent, self.cost_model)
        for group in inside:
            row.remove(group)
            for item in group.items:
                merged.add(item, self.cost_model)
        claim(merged, owners, row)

    def split_for_vpp(self, rows: List[Row]) -> None:
        """Step 4: split the fullest micro-batch until the count is a multiple of the VPP size."""
        k = self.microbatch_group_size_per_vp_stage
        while k and len(rows) % k:
            fullest = max(rows, key=lambda row: sum(len(g.items) for g in row))  # first on ties
            items = longest_first([item for group in fullest for item in group.items])
            if len(items) < 2:
                raise ValueError(
                    f"{PEER_NAME}: cannot reach a multiple of {k} micro-batches: every "
                    "micro-batch holds one sequence"
                )
            rows.remove(fullest)
            for half in (items[0::2], items[1::2]):
                while half:
                    row, half = self.fill_row(half)
                    rows.append(row)


def longest_first(items: Sequence[Item]) -> List[Item]:
    return sorted(items, key=lambda item: (-item.seqlen, item.sample_id))


def buddy(block: Block) -> Block:
    return Block(block.start ^ block.size, block.size)


def is_free(block: Block, owners: Sequence[Optional[GroupDraft]]) -> bool:
    return block.stop <= len(owners) and not any(owners[block.start : block.stop])


def claim(group: GroupDraft, owners: List[Optional[GroupDraft]], row: Row) -> GroupDraft:
    """Add ``group`` to the row and mark its positions."""
    owners[group.block.start : group.block.stop] = [group] * group.size
    row.append(group)
    return group
