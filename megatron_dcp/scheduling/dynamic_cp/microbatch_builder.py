"""``MicroBatchBuilder``: the placement of samples in one micro-batch under construction. It
opens the micro-batch with its heaviest sample, then places the others on fresh blocks or on the
least-loaded group where they fit under the level (one heap of groups per CP size)."""

from __future__ import annotations

import heapq
from itertools import compress
from operator import not_
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.buddy import BuddyAllocator
from megatron_dcp.scheduling.draft import GroupDraft, Item
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft

INF = float("inf")

HeapEntry = Tuple[float, int, GroupDraft]
# The groups of one CP size: (size, their heap, the tokens a group holds, per-rank costs by cost
# key: a length, or (length, patches)).
Lane = Tuple[int, List[HeapEntry], int, Dict[Any, float]]


class MicroBatchBuilder:
    """One micro-batch under construction: its groups (a heap of them per CP size, least-loaded
    on top), its free blocks, and its level (the per-rank cost no sample may push a group past)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        knobs = ctx.knobs
        self.fail_limit = knobs.fail_limit * max(1, ctx.domain.size // knobs.fail_span)
        self.skip_limit = knobs.skip_limit
        self.free = BuddyAllocator(ctx.domain)
        self.groups: MicroBatchDraft = []
        self.heaps: Dict[int, List[HeapEntry]] = {}
        self.lanes: List[Lane] = []  # one per key of ``heaps``, by ascending size
        self.level = 0.0
        self.shortest = 0  # the shortest sample still to place: groups with less room are full
        # The shortest sample that missed since a full group last left its heap (see ``_pass``).
        self.misfit = INF
        self.dropped = 0  # groups too full for any sample that left their heap
        # CP size -> the most token room among the groups the last join looked at, where none
        # had room for its sample; ``misfit`` came from such a bound (see ``_pass``).
        self.token_bounds: Dict[int, int] = {}
        self.misfit_by_tokens = False
        # Placements (group, sample, load, fresh) recorded for :meth:`undo` when not None.
        self.journal: Optional[List[Tuple[GroupDraft, Item, float, bool]]] = None

    def open(self, item: Item, size: int, floor: float) -> None:
        """Place the first sample on a fresh group of ``size`` ranks; the level is its cost or
        ``floor``, whichever is higher."""
        self._add_group(item, size)
        self.level = max(self.groups[0].load, floor) * (1 + self.ctx.knobs.eps)

    def fill_from(self, pool: Sequence[Item]) -> List[Item]:
        """Place what fits of ``pool`` (heaviest first: its last sample is the shortest), then top
        up lightest first; returns the samples not placed, in pool order."""
        taken = [False] * len(pool)
        if self.ctx.vision:  # heaviest first is no longer longest first
            self.shortest = min(item.seqlen for item in pool) if pool else 0
        else:
            self.shortest = pool[-1].seqlen if pool else 0
        self.misfit = INF
        resume = self._pass(pool, range(len(pool)), taken)
        self._pass(pool, range(len(pool) - 1, resume - 1, -1), taken)
        return list(compress(pool, map(not_, taken)))

    def _pass(self, pool: Sequence[Item], order: range, taken: List[bool]) -> int:
        """Try the samples of ``pool`` in ``order``; returns the first index not tried (a pass
        ends after ``fail_limit`` consecutive misses once no rank is free).

        Placing only ever raises loads and takes free ranks, and a longer sample costs more and
        needs at least as many ranks, so a sample at least as long as one known to miss misses
        too (``misfit``, see :meth:`_misfit_after`) and counts as a miss untried. Only a text
        sample's miss sets ``misfit`` (vision work adds to a length's cost: a sample with
        patches that misses says nothing of a text sample as long; one as long as a text
        miss misses). A full group leaving its heap lets :meth:`_join` look further, and a
        placement can bring a group with more token room among those it looks at: ``misfit``
        is forgotten then."""
        place = self._place_lowest if self.level == INF else self._place_under_level
        misses = 0
        for index in order:
            if taken[index]:
                continue
            item, dropped = pool[index], self.dropped
            placed = item.seqlen < self.misfit and place(item)
            if self.dropped != dropped or (placed and self.misfit_by_tokens):
                self.misfit, self.misfit_by_tokens = INF, False
            elif not placed and item.seqlen < self.misfit and item.key.__class__ is not tuple:
                self.misfit = self._misfit_after(item)
            if placed:
                taken[index], misses = True, 0
            elif not self.free.free:
                misses += 1
                if misses >= self.fail_limit:
                    return index + 1
        return order.stop if order.step > 0 else len(pool)

    def _misfit_after(self, item: Item) -> int:
        """The shortest length known to miss after ``item`` missed: its own, or, once no rank is
        free under a level, one more than the longest some CP size could still take: by the token
        room of the groups :meth:`_join` looked at (``token_bounds``) where it lacked room, else
        by the load of its least-loaded group (:meth:`_longest_by_load`). A long run of misses
        then costs one search."""
        if self.free.free or self.level == INF:
            return item.seqlen
        longest, below = -1, item.seqlen  # the longest length some CP size may still take
        for lane in self.lanes:
            if not lane[1] or longest >= below - 1:
                continue
            room = self.token_bounds.get(lane[0])
            longest = max(longest, room if room is not None else self._longest_by_load(lane, below))
        self.misfit_by_tokens = bool(self.token_bounds)
        return min(below, longest + 1)

    def _longest_by_load(self, lane: Lane, below: int) -> int:
        """The longest length under ``below`` that the least-loaded group of ``lane`` could take
        without passing the level (token room and minimum CP size ignored: a bound), or -1.
        Costs grow with the length: a binary search."""
        _, heap, _, costs = lane
        load, level, low, high = heap[0][0], self.level, -1, below - 1
        while low < high:
            middle = (low + high + 1) // 2
            if load + costs[middle] <= level:  # the test of :meth:`_join`, bit for bit
                low = middle
            else:
                high = middle - 1
        return low

    def _place_under_level(self, item: Item) -> bool:
        """Put ``item`` on a fresh block of the smallest size whose cost fits under the level,
        else on the least-loaded group where it fits; False when it fits nowhere."""
        if self.free.free and self._place_fresh(item):
            return True
        return self._join(item)

    def _place_lowest(self, item: Item) -> bool:
        """Without a level (``level`` infinite): put ``item`` where its resulting per-rank load is
        least, the cheapest fresh block of any size ≥ its minimum unless joining a group ends
        lower; False when it fits nowhere."""
        fresh: Optional[Tuple[float, int]] = None
        if self.free.free and (item.seqlen > 0 or not self.groups):
            for size in self.ctx.sizes_from(item.min_cp):
                load = self.ctx.alone(item.key, size)
                if (fresh is None or load < fresh[0]) and self.free.can_allocate(size):
                    fresh = (load, size)
        self.level = fresh[0] if fresh else INF
        try:
            if self._join(item):
                return True
        finally:
            self.level = INF
        if fresh is None:
            return False
        self._add_group(item, fresh[1])
        return True

    def undo(self) -> None:
        """Take back the placements recorded in the journal (the heaps are not kept: call only
        when no more samples will be placed)."""
        for group, item, load, fresh in reversed(self.journal or []):
            group.pop(item, load)
            if fresh:
                self.groups.remove(group)
                self.free.free.append(group.block)
        self.journal = None

    def _place_fresh(self, item: Item) -> bool:
        if item.seqlen == 0 and self.groups:
            return False  # an empty sample alone would leave its ranks without work
        alone, key, level, free = self.ctx.alone, item.key, self.level, self.free
        for size in self.ctx.sizes_from(item.min_cp):
            if alone(key, size) <= level and free.can_allocate(size):
                self._add_group(item, size)
                return True
        return False

    def _join(self, item: Item) -> bool:
        """Add ``item`` to the group where its resulting load is least and within the level."""
        best_total, best = self.level, None
        if self.token_bounds:
            self.token_bounds = {}
        skipped: List[Tuple[List[HeapEntry], int, HeapEntry]] = []
        seqlen, min_cp = item.seqlen, item.min_cp
        for lane in self.lanes:
            size, heap, capacity, costs = lane
            if size < min_cp or not heap:
                continue
            if heap[0][2].tokens > capacity - seqlen:
                mark = len(skipped)
                self._skip_full(heap, capacity, capacity - seqlen, skipped)
                if not heap or heap[0][2].tokens > capacity - seqlen:
                    self._bound_tokens(lane, skipped[mark:])
                    continue
            total = heap[0][0] + costs[item.key]
            if total < best_total or (total == best_total and best is None):
                best_total, best = total, lane
        if best is not None:
            heap, load = best[1], best[3][item.key]
            group = heap[0][2]
            group.push(item, load)
            heapq.heapreplace(heap, (group.load, group.block.start, group))
            if self.journal is not None:
                self.journal.append((group, item, load, False))
        for heap, capacity, entry in skipped:  # groups too full for any sample leave the heap
            if capacity - entry[2].tokens >= self.shortest:
                heapq.heappush(heap, entry)
            else:
                self.dropped += 1
        return best is not None

    def _bound_tokens(self, lane: Lane, popped: List[Tuple[List[HeapEntry], int, HeapEntry]]):
        """Record in ``token_bounds`` the most token room among the groups of ``lane`` that
        :meth:`_join` popped (``popped``) or found on top, none of which had room for it."""
        size, heap, capacity, _ = lane
        least = min(entry[2].tokens for _, _, entry in popped)
        if heap:
            least = min(least, heap[0][2].tokens)
        self.token_bounds[size] = capacity - least

    def _skip_full(
        self,
        heap: List[HeapEntry],
        capacity: int,
        limit: int,
        skipped: List[Tuple[List[HeapEntry], int, HeapEntry]],
    ) -> None:
        """Pop (into ``skipped``) up to ``knobs.skip_limit`` least-loaded groups holding more than
        ``limit`` tokens (no room for the sample)."""
        for _ in range(self.skip_limit):
            if not heap or heap[0][2].tokens <= limit:
                return
            skipped.append((heap, capacity, heapq.heappop(heap)))

    def _add_group(self, item: Item, size: int) -> None:
        block = self.free.allocate(size)
        assert block is not None, f"no free block of {size} ranks"
        group = self.ctx.group(block)
        group.push(item, self.ctx.load(item.key, size))
        self.groups.append(group)
        if self.journal is not None:
            self.journal.append((group, item, group.load, True))
        if size not in self.heaps:
            self.heaps[size] = []
            lane = (size, self.heaps[size], size * self.ctx.domain.budget, self.ctx.per_size[size])
            self.lanes = sorted(self.lanes + [lane], key=lambda lane: lane[0])
        heapq.heappush(self.heaps[size], (group.load, block.start, group))
