"""Greedy balanced partitioning shared by the schedulers."""

from __future__ import annotations

import heapq
from typing import Callable, List, Optional, Sequence

from megatron_dcp.scheduling.draft import Item


def lpt_partition(
    items: Sequence[Item],
    num_bins: int,
    capacity: int,
    weight: Callable[[Item], float],
    ordered: bool = False,
) -> Optional[List[List[Item]]]:
    """Longest-processing-time partition of ``items`` into ``num_bins`` bins of at most
    ``capacity`` tokens each: heaviest item first, into the least-loaded bin that has room
    (``ordered``: ``items`` are already by decreasing weight, then id).

    Returns None when an item fits in no bin. Ties break on the number of items, then the bin
    index (deterministic, and weightless items still spread over the bins).
    """
    bins: List[List[Item]] = [[] for _ in range(num_bins)]
    tokens = [0] * num_bins
    heap = [(0.0, 0, index) for index in range(num_bins)]
    order = items if ordered else sorted(items, key=lambda it: (-weight(it), it.sample_id))
    for item, item_weight in zip(order, map(weight, order)):
        seqlen = item.seqlen
        if heap and tokens[heap[0][2]] + seqlen <= capacity:  # the least-loaded bin has room
            load, count, index = heap[0]
            heapq.heapreplace(heap, (load + item_weight, count + 1, index))
        else:
            entry = _pop_with_room(heap, tokens, seqlen, capacity)
            if entry is None:
                return None
            load, count, index = entry
            heapq.heappush(heap, (load + item_weight, count + 1, index))
        bins[index].append(item)
        tokens[index] += seqlen
    return bins


def _pop_with_room(heap: list, tokens: List[int], seqlen: int, capacity: int) -> Optional[tuple]:
    """Pop the least-loaded bin with room for ``seqlen`` tokens off ``heap`` (the fuller ones
    stay); None when no bin has room."""
    skipped = []
    while heap and tokens[heap[0][2]] + seqlen > capacity:
        skipped.append(heapq.heappop(heap))
    entry = heapq.heappop(heap) if heap else None
    for skipped_entry in skipped:
        heapq.heappush(heap, skipped_entry)
    return entry


def align_microbatch_count(count: int, group_size: Optional[int]) -> int:
    """VPP alignment: the smallest multiple of ``group_size`` that is ≥ ``count``."""
    if not group_size:
        return count
    return -(-count // group_size) * group_size
