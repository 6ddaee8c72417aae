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
    for item in items if ordered else sorted(items, key=lambda it: (-weight(it), it.sample_id)):
        skipped = []
        while heap and tokens[heap[0][2]] + item.seqlen > capacity:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, count, index = heapq.heappop(heap)
        bins[index].append(item)
        tokens[index] += item.seqlen
        heapq.heappush(heap, (load + weight(item), count + 1, index))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return bins


def align_microbatch_count(count: int, group_size: Optional[int]) -> int:
    """VPP alignment: the smallest multiple of ``group_size`` that is ≥ ``count``."""
    if not group_size:
        return count
    return -(-count // group_size) * group_size
