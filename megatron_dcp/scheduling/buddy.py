"""Free positions of a micro-batch under construction, handed out as aligned CP-group blocks."""

from __future__ import annotations

from typing import List, Optional

from megatron_dcp.scheduling.domain import Block, Domain, is_power_of_two


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
            splittable = next((b for b in candidates if self.domain.children(b)), None)
            if splittable is None:
                return None
            self.free.remove(splittable)
            self.free.extend(self.domain.children(splittable))

    def can_allocate(self, size: int) -> bool:
        return any(b.size >= size and self._reaches(b, size) for b in self.free)

    def _reaches(self, block: Block, size: int) -> bool:
        if block.size == size:
            return True
        return any(self._reaches(child, size) for child in self.domain.children(block))


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
