"""Mutable working state of a scheduler: groups and micro-batches under construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import List, NamedTuple, Optional, Sequence

from megatron_dcp.scheduling.cost import CostKey, CostModel, key_patches
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.plan import CPGroup, MicroBatch


class Item(NamedTuple):
    """One sample as the scheduler sees it (a tuple: tens of thousands are made per plan).
    ``key`` is what prices it (``cost.cost_keys``): its length (the default) or, for a sample
    with vision work, ``(length, patches)``; every per-rank cost is looked up by it."""

    sample_id: int
    seqlen: int
    min_cp: int
    key: CostKey = 0


def _new_item(cls, sample_id: int, seqlen: int, min_cp: int, key: Optional[CostKey] = None):
    return _TUPLE_NEW(cls, (sample_id, seqlen, min_cp, seqlen if key is None else key))


_TUPLE_NEW = tuple.__new__
Item.__new__ = staticmethod(_new_item)  # type: ignore[method-assign]  # key defaults to seqlen

SEQLEN = attrgetter("seqlen")
SAMPLE_ID = attrgetter("sample_id")
KEY = attrgetter("key")


@dataclass(eq=False, slots=True)
class GroupDraft:
    """A CP group being filled: its block, its samples, per-rank load (ring steps included once
    it holds a sample) and token count. ``ring`` is the cost model's ``ring_cost`` of its size."""

    block: Block
    ring: float = 0.0
    items: List[Item] = field(default_factory=list)
    load: float = 0.0
    tokens: int = 0

    @classmethod
    def over(cls, block: Block, cost: CostModel) -> "GroupDraft":
        """An empty group over ``block`` whose ring steps ``cost`` prices."""
        return cls(block, cost.ring_cost(block.size))

    @property
    def size(self) -> int:
        return self.block.size

    def fits(self, item: Item, budget: int) -> bool:
        return item.min_cp <= self.size and self.tokens + item.seqlen <= self.size * budget

    def add(self, item: Item, cost: CostModel) -> None:
        self.push(item, cost.sample_cost(item.seqlen, key_patches(item.key), self.size))

    def remove(self, item: Item, cost: CostModel) -> None:
        self.pop(item, cost.sample_cost(item.seqlen, key_patches(item.key), self.size))

    def push(self, item: Item, load: float) -> None:
        """Add ``item`` whose per-rank cost on this group is ``load`` (precomputed: hot path);
        the first sample brings the ring steps."""
        if not self.items:
            self.load += self.ring
        self.items.append(item)
        self.load += load
        self.tokens += item.seqlen

    def pop(self, item: Item, load: float) -> None:
        """Remove ``item`` whose per-rank cost on this group is ``load``."""
        self.items.remove(item)
        self.load -= load
        self.tokens -= item.seqlen
        if not self.items:
            self.load, self.tokens = 0.0, 0

    def freeze(self) -> CPGroup:
        return CPGroup(self.block.positions, tuple(map(SAMPLE_ID, self.items)))


def group_of_items(block: Block, items: Sequence[Item], cost: CostModel) -> GroupDraft:
    group = GroupDraft.over(block, cost)
    for item in items:
        group.add(item, cost)
    return group


def freeze_microbatch(groups: Sequence[GroupDraft]) -> MicroBatch:
    """Freeze a micro-batch; groups ordered by position, samples longest first (deterministic)."""
    frozen = []
    for group in sorted(groups, key=lambda g: g.block.start):
        if len(group.items) > 1:
            longest_first(group.items)
        frozen.append(group.freeze())
    return MicroBatch(tuple(frozen))


def longest_first(items: List[Item]) -> List[Item]:
    """Sort ``items`` in place by decreasing length, then id (two C-level stable sorts: the
    hot path of planning); returns them."""
    items.sort(key=SAMPLE_ID)
    items.sort(key=SEQLEN, reverse=True)
    return items
