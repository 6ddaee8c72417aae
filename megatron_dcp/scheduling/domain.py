"""The DP×CP domain: its size, the CP groups that exist in it, and the CP degree rule."""

from __future__ import annotations

import operator
from bisect import bisect_left
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, Iterable, NamedTuple, Optional, Sequence, Tuple

from megatron_dcp.scheduling.errors import SchedulingError


def is_power_of_two(value: int) -> bool:
    """True for 1, 2, 4, ...; False for zero and negatives."""
    return value > 0 and value & (value - 1) == 0


def largest_power_of_two_at_most(value: int) -> int:
    """The largest power of two that is ≤ ``value`` (``value`` ≥ 1)."""
    return 1 << (value.bit_length() - 1)


def budget_multiple(tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """What a per-rank budget must be a multiple of for the training entry points: every
    sequence is padded to a multiple of 2 × CP size (× TP size under sequence parallelism), so a
    budget of this multiple lets a sequence of exactly CP size × budget tokens need no padding."""
    return 2 * (tp_size if sequence_parallel else 1)


def least_budget(seqlen: int, ranks: int, multiple: int = budget_multiple()) -> int:
    """The smallest budget, a multiple of ``multiple``, with which ``ranks`` ranks hold a
    sequence of ``seqlen`` tokens (the training entry points accept it as it is)."""
    per_rank = max(1, -(-seqlen // ranks))
    return -(-per_rank // multiple) * multiple


def size_choices(largest: int) -> str:
    """The powers of two from 1 to ``largest`` in words: "1", "1 or 2", "1, 2 or 4",
    "1, 2, 4, ... up to 64"."""
    sizes = [1 << k for k in range(largest.bit_length())]
    if len(sizes) > 4:
        return f"1, 2, 4, ... up to {largest}"
    return " or ".join(filter(None, [", ".join(map(str, sizes[:-1])), str(sizes[-1])]))


class Block(NamedTuple):
    """An aligned block of positions ``[start, start + size)``: the footprint of one CP group (a
    tuple: planning makes tens of thousands)."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def positions(self) -> Tuple[int, ...]:
        return tuple(range(self.start, self.stop))


@dataclass(frozen=True)
class Domain:
    """The DP×CP ranks (size ``N = dp_size * cp_size``) and the DCP settings that shape plans.

    CP groups exist for every power of two ``s`` with ``min_cp_size ≤ s ≤ N`` (one per aligned block
    ``[j·s, (j+1)·s)`` that fits in the domain) and for the whole domain (size ``N``, which need not
    be a power of two). Any N ≥ 1 is supported; for N that is not a multiple of ``min_cp_size`` only
    the whole-domain group can partition the domain.
    """

    dp_size: int
    cp_size: int
    max_seqlen_per_dp_cp_rank: int
    min_cp_size: int = 1

    def __post_init__(self) -> None:
        for name, value in (("dp_size", self.dp_size), ("cp_size", self.cp_size)):
            if not isinstance(value, int) or value < 1:
                raise SchedulingError(
                    "{%s}={value!r}: must be a positive integer." % name, value=value
                )
        budget = self.max_seqlen_per_dp_cp_rank
        if not isinstance(budget, int) or budget <= 0:
            raise SchedulingError(
                "{budget}={value!r}: the per-rank token budget must be a positive integer; "
                "set it to the most tokens one rank may hold in a micro-batch (e.g. 4096).",
                value=budget,
            )
        if not is_power_of_two(self.min_cp_size) or self.min_cp_size > self.size:
            raise SchedulingError(
                "{min_cp_size}={value!r}: must be a power of two between 1 and the DP×CP domain "
                "size {size} (dp {dp} × cp {cp}); use {choices}.",
                value=self.min_cp_size,
                size=self.size,
                dp=self.dp_size,
                cp=self.cp_size,
                choices=size_choices(largest_power_of_two_at_most(self.size)),
            )

    @property
    def size(self) -> int:
        """N, the number of positions (DP×CP ranks)."""
        return self.dp_size * self.cp_size

    @property
    def budget(self) -> int:
        return self.max_seqlen_per_dp_cp_rank

    @cached_property
    def group_sizes(self) -> Tuple[int, ...]:
        """Sizes for which CP groups exist, ascending."""
        sizes = []
        size = self.min_cp_size
        while size <= self.size:
            sizes.append(size)
            size *= 2
        if self.size not in sizes:
            sizes.append(self.size)
        return tuple(sizes)

    @cached_property
    def max_tokens_per_sequence(self) -> int:
        return self.size * self.budget

    def is_group_block(self, block: Block) -> bool:
        """True when a CP group (a communicator) exists for exactly this block."""
        if block.size == self.size:
            return block.start == 0
        return (
            block.size in self.group_sizes
            and is_power_of_two(block.size)
            and block.start % block.size == 0
            and 0 <= block.start
            and block.stop <= self.size
        )

    def blocks(self, size: int) -> Tuple[Block, ...]:
        """The blocks of ``size`` positions that have a CP group, by start."""
        candidates = (Block(start, size) for start in range(0, self.size - size + 1, size))
        return tuple(block for block in candidates if self.is_group_block(block))

    def cp_degree(self, seqlen: int) -> int:
        """Smallest group size ≥ ``min_cp_size`` whose per-rank share of ``seqlen`` fits the budget."""
        index = bisect_left(self.group_sizes, -(-seqlen // self.budget))
        if index == len(self.group_sizes):
            raise self.too_long_error(seqlen)
        return self.group_sizes[index]

    def cp_degrees(self, seqlens: Iterable[int]) -> Dict[int, int]:
        """:meth:`cp_degree` of each distinct length (a batch repeats lengths)."""
        return {seqlen: self.cp_degree(seqlen) for seqlen in set(seqlens)}

    def too_long_error(
        self, seqlen: int, sample_id: Optional[int] = None, too_long: int = 1
    ) -> SchedulingError:
        """A sequence of ``seqlen`` tokens does not fit the whole domain: the budget that holds
        it (give the longest sequence of the input, so that the hint holds for every one, and
        ``too_long``, how many do not fit)."""
        which = f"sample {sample_id} has" if sample_id is not None else "a sequence has"
        others = f"; it is the longest of {too_long} that do not fit" if too_long > 1 else ""
        return SchedulingError(
            "{budget}={value}: {which} {seqlen} tokens, more than the whole DP×CP domain can hold "
            "({size} ranks × {value} = {capacity}{others}). Raise {budget} to at least {least}, "
            "use more DP×CP ranks, or use {max_seqlen}.",
            others=others,
            value=self.budget,
            which=which,
            seqlen=seqlen,
            size=self.size,
            capacity=self.max_tokens_per_sequence,
            least=least_budget(seqlen, self.size),
        )

    def longest_too_long_error(self, seqlens: Sequence[int]) -> SchedulingError:
        """:meth:`too_long_error` for the longest of ``seqlens`` (which has one too long)."""
        sample_id = max(range(len(seqlens)), key=seqlens.__getitem__)
        too_long = sum(seqlen > self.max_tokens_per_sequence for seqlen in seqlens)
        return self.too_long_error(seqlens[sample_id], sample_id, too_long)

    def root(self) -> Block:
        return Block(0, self.size)

    def children(self, block: Block) -> Tuple[Block, ...]:
        """The blocks a group may be split into: halves of a power-of-two block, and the binary
        decomposition (largest power of two first) of a non-power-of-two domain. Empty when the
        pieces would be smaller than ``min_cp_size``."""
        if is_power_of_two(block.size):
            half = block.size // 2
            parts = [Block(block.start, half), Block(block.start + half, half)] if half else []
        else:
            parts, start, rest = [], block.start, block.size
            while rest:
                part = largest_power_of_two_at_most(rest)
                parts.append(Block(start, part))
                start, rest = start + part, rest - part
        if any(part.size < self.min_cp_size for part in parts):
            return ()
        return tuple(parts)

    def check_seqlens(self, seqlens: Iterable[int]) -> Tuple[int, ...]:
        """Validate user lengths: non-negative ints that fit the domain. Returns them as a tuple.
        A length that does not fit is reported by the longest one, so that the budget the error
        asks for holds every length."""
        lengths = tuple(seqlens)
        if not (set(map(type, lengths)) <= {int} and (not lengths or 0 <= min(lengths))):
            lengths = self._check_each(lengths)  # plain ints (the common case) skip this loop
        if lengths and max(lengths) > self.max_tokens_per_sequence:
            raise self.longest_too_long_error(lengths)
        return lengths

    def _check_each(self, seqlens: Tuple) -> Tuple[int, ...]:
        """:meth:`check_seqlens` one length at a time: converts integer types, names the first
        bad length."""
        lengths = []
        for sample_id, seqlen in enumerate(seqlens):
            try:
                value = operator.index(seqlen)
            except TypeError:
                value = -1
            if value < 0 or isinstance(seqlen, bool):
                raise SchedulingError(
                    "seqlens[{sample_id}]={seqlen!r}: sequence lengths must be non-negative "
                    "integers (token counts); check the dataset's sample lengths.",
                    sample_id=sample_id,
                    seqlen=seqlen,
                )
            lengths.append(value)
        return tuple(lengths)
