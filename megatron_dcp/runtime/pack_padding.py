"""Padding of a whole THD pack, with the meaning Megatron dev gives its packing flags.

A rank's pack holds its CP group's sequences of one micro-batch, each padded to ``2·c`` (the
zigzag chunks). Kernels and FP8 may need more: the pack's local length aligned to a multiple of
``N`` tokens, or always the per-rank budget (``max``, a fixed shape for CUDA graphs). The extra
tokens, the *tail*, are padding (token 0, label 0, no loss) and are added to the global layout
before CP slicing, so that every rank of the group receives ``tail / c`` of them. The tail is
either one more sequence with no real tokens (``append_dummy_seq``, the default) or an extension
of the last sequence's padding (``extend_last``). A cap on the sequences of one pack
(``max_sequences``, the dummy tail included) lets ``cu_seqlens`` keep a fixed size: both
``cu_seqlens`` tensors are padded to ``max_sequences + 1`` entries by repeating their last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

ALIGN_TO_BUDGET = "max"
TAIL_POLICIES = ("append_dummy_seq", "extend_last")
Alignment = Union[None, int, str]


@dataclass(frozen=True)
class PackPadding:
    """How a rank's pack is padded: ``alignment`` (None, a positive even token count or
    ``"max"``, which needs ``budget``), ``tail_policy`` and ``max_sequences`` (None: no cap)."""

    alignment: Alignment = None
    budget: Optional[int] = None
    max_sequences: Optional[int] = None
    tail_policy: str = TAIL_POLICIES[0]

    def __post_init__(self) -> None:
        if self.tail_policy not in TAIL_POLICIES:
            raise ValueError(f"tail_policy={self.tail_policy!r}: choose one of {TAIL_POLICIES}")
        if self.alignment == ALIGN_TO_BUDGET and self.budget is None:
            raise ValueError("alignment 'max' pads to the per-rank budget: give the budget")
        if isinstance(self.alignment, int) and self.alignment < 1:
            raise ValueError(f"alignment={self.alignment}: must be 'max' or a positive integer")
        if self.max_sequences is not None and self.max_sequences < 1 + self.dummy_slot:
            raise ValueError(f"max_sequences={self.max_sequences}: the pack needs room")

    @property
    def dummy_slot(self) -> int:
        """1 when an aligned pack may end with a dummy tail sequence (it takes a slot)."""
        return int(self.alignment is not None and self.tail_policy == "append_dummy_seq")

    @property
    def sample_cap(self) -> Optional[int]:
        """The most samples one pack may hold: the cap less the dummy tail's slot."""
        return None if self.max_sequences is None else self.max_sequences - self.dummy_slot

    def local_target(self, local_tokens: int) -> int:
        """The local length a pack of ``local_tokens`` is padded to."""
        if self.alignment is None:
            return local_tokens
        if self.alignment == ALIGN_TO_BUDGET:
            target = self.budget
        else:
            target = -(-local_tokens // self.alignment) * self.alignment
        if local_tokens > target:
            raise ValueError(
                f"a pack of {local_tokens} tokens per rank exceeds the budget {target} that "
                "alignment 'max' pads to: the plan broke the per-rank budget"
            )
        return target

    def fixed_entries(self, bounds: List[int]) -> List[int]:
        """``bounds`` (cumulative, first 0) padded to ``max_sequences + 1`` entries."""
        sequences = len(bounds) - 1
        if self.max_sequences is None:
            return bounds
        if sequences > self.max_sequences:
            raise ValueError(
                f"a pack of {sequences} sequences exceeds the cap of {self.max_sequences} "
                "(--thd-max-packed-sequences): the plan put too many samples in one CP group"
            )
        return bounds + [bounds[-1]] * (self.max_sequences - sequences)


NO_PADDING = PackPadding()
