"""Free positions of a micro-batch under construction, handed out as aligned CP-group blocks."""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Tuple

from megatron_dcp.scheduling.domain import Block, Domain, is_power_of_two


@lru_cache(maxsize=1 << 16)
def _children(domain: Domain, block: Block) -> Tuple[Block, ...]:
    return domain.children(block)


@lru_cache(maxsize=1 << 16)
def _reaches(domain: Domain, block: Block, size: int) -> bool:
    """True when splitting ``block`` along the domain tree yields a block of ``size`` ranks."""
    if block.size == size:
        return True
    return block.size > size and any(_reaches(domain, c, size) for c in _children(domain, block))


class BuddyAllocator:
    """Hands out blocks for which CP groups exist, splitting free blocks along the domain tree
    (halves of power-of-two blocks; the binary decomposition of a non-power-of-two domain)."""

    def __init__(self, domain: Domain) -> None:
        self.domain = domain
        self.free: List[Block] = [domain.root()]

    def allocate(self, size: int) -> Optional[Block]:
        """Take a free block of exactly ``size`` positions, splitting a larger one if needed."""
        while True:
            candidates = sorted(
                (b for b in self.free if b.size >= size), key=lambda b: (b.size, b.start)
            )
            block = next((b for b in candidates if b.size == size), None)
            if block is not None:
                self.free.remove(block)
                return block
            splittable = next((b for b in candidates if _children(self.domain, b)), None)
            if splittable is None:
                return None
            self.free.remove(splittable)
            self.free.extend(_children(self.domain, splittable))

    def can_allocate(self, size: int) -> bool:
        return any(b.size >= size and _reaches(self.domain, b, size) for b in self.free)


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
