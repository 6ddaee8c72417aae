"""Free positions of a micro-batch under construction, handed out as aligned CP-group blocks."""

from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from megatron_dcp.scheduling.domain import Block, Domain, is_power_of_two


@lru_cache(maxsize=1 << 16)
def _children(domain: Domain, block: Block) -> Tuple[Block, ...]:
    return domain.children(block)


@lru_cache(maxsize=64)
def _reach_table(domain: Domain) -> Dict[Tuple[int, int, int], bool]:
    """Memo of :func:`_reaches` for one domain, keyed by (start, block size, size)."""
    return {}


def _reaches(domain: Domain, block: Block, size: int, table: Dict) -> bool:
    """True when splitting ``block`` along the domain tree yields a block of ``size`` ranks
    (``table``: the domain's :func:`_reach_table`)."""
    if block.size == size:
        return True
    key = (block.start, block.size, size)
    value = table.get(key)
    if value is None:
        children = _children(domain, block)
        value = block.size > size and any(_reaches(domain, c, size, table) for c in children)
        table[key] = value
    return value


class BuddyAllocator:
    """Hands out blocks for which CP groups exist, splitting free blocks along the domain tree
    (halves of power-of-two blocks; the binary decomposition of a non-power-of-two domain)."""

    def __init__(self, domain: Domain) -> None:
        self.domain = domain
        self.free: List[Block] = [domain.root()]
        self._table = _reach_table(domain)
        # In a power-of-two domain every block halves down to every group size below it.
        self._halves = is_power_of_two(domain.size)

    def allocate(self, size: int) -> Optional[Block]:
        """Take a free block of exactly ``size`` positions (the lowest), splitting the smallest
        larger block that can yield one (the lowest of them) if needed; None when none can."""
        if self._halves:
            return self._allocate_halving(size)
        free = self.free
        while True:
            exact = larger = -1  # indices into ``free``
            for index, block in enumerate(free):
                if block.size == size:
                    if exact < 0 or block.start < free[exact].start:
                        exact = index
                elif block.size > size and (
                    larger < 0
                    or (block.size, block.start) < (free[larger].size, free[larger].start)
                ):
                    if self._reaches(block, size):
                        larger = index
            if exact >= 0:
                return free.pop(exact)
            if larger < 0:
                return None
            free.extend(_children(self.domain, free.pop(larger)))

    def _allocate_halving(self, size: int) -> Optional[Block]:
        """:meth:`allocate` in a power-of-two domain: the smallest free block of at least
        ``size`` ranks (the lowest of them), halved down to ``size``, upper halves left free."""
        free, best, best_start, best_size = self.free, -1, 0, 0
        for index, (start, block_size) in enumerate(free):
            if block_size >= size and (
                best < 0
                or block_size < best_size
                or (block_size == best_size and start < best_start)
            ):
                best, best_start, best_size = index, start, block_size
        if best < 0:
            return None
        block = free.pop(best)
        while block.size > size:
            half = block.size // 2
            free.append(Block(block.start + half, half))
            block = Block(block.start, half)
        return block

    def can_allocate(self, size: int) -> bool:
        """True when a block of ``size`` ranks can be taken (directly or by splitting)."""
        if self._halves:
            for block in self.free:
                if block.size >= size:
                    return True
            return False
        return any(b.size >= size and self._reaches(b, size) for b in self.free)

    def _reaches(self, block: Block, size: int) -> bool:
        if self._halves:
            return block.size >= size
        return _reaches(self.domain, block, size, self._table)


def parent_block(domain: Domain, block: Block) -> Block:
    """The smallest group block strictly containing ``block`` (the root for top-level parts)."""
    double = block.size * 2
    start = block.start - block.start % double
    candidate = Block(start, double)
    if is_power_of_two(double) and candidate.stop <= domain.size and double < domain.size:
        return candidate
    return domain.root()


def contains(outer: Block, inner: Block) -> bool:
    return outer.start <= inner.start and inner.stop <= outer.stop
