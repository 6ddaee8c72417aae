"""Sequence-length exchange for one global batch (step 1 of docs/architecture.md, "The life of
one global batch").

``gather_lengths`` / ``all_gather_seqlens``: every rank learns every length of the global batch
(an all-gather over DP), so every rank can compute the same plan. The samples themselves move in
``runtime.routing`` once the plan is known.

gloo (torch 2.13, CPU) rejects list-form ``all_gather`` of tensors of unequal sizes, so the
lengths travel padded to the largest count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class GlobalLengths:
    """All lengths of a global batch; sample ids are DP-rank-major (DP rank 0's samples first)."""

    seqlens: tuple[int, ...]
    counts: tuple[int, ...]  # samples held by each DP rank

    def ids_of(self, dp_rank: int) -> range:
        """Global sample ids held by ``dp_rank``."""
        start = sum(self.counts[:dp_rank])
        return range(start, start + self.counts[dp_rank])

    def owner_of(self, sample_id: int) -> int:
        """The DP rank holding ``sample_id``."""
        for dp_rank, count in enumerate(self.counts):
            if sample_id < count:
                return dp_rank
            sample_id -= count
        raise ValueError(f"sample id out of range: the batch has {len(self.seqlens)} samples")


def gather_lengths(local_seqlens: Sequence[int], dp_group: Optional[ProcessGroup]) -> GlobalLengths:
    """All-gather every DP rank's sample lengths (counts may differ per DP rank).

    Two small int64 all-gathers over ``dp_group`` (gloo needs equal sizes): the counts, then
    the lengths padded to the largest count, on the device the group's backend communicates from.
    A rank holding a negative length sends the count -1, so every rank raises the same
    ``ValueError`` after the first all-gather instead of the others waiting in the second.
    """
    device = collective_device(dp_group)
    local = torch.tensor([int(n) for n in local_seqlens], dtype=torch.int64, device=device)
    valid = not bool((local < 0).any())
    count = torch.tensor([local.numel() if valid else -1], dtype=torch.int64, device=device)
    counts_list = [int(c.item()) for c in all_gather_equal(count, dp_group)]
    if min(counts_list) < 0:
        bad = [rank for rank, c in enumerate(counts_list) if c < 0]
        mine = f" (this rank's: {list(local_seqlens)})" if not valid else ""
        raise ValueError(
            f"sequence lengths must be non-negative token counts; DP ranks {bad} hold negative "
            f"lengths{mine}. Check the dataset's samples (tokens of length ≥ 0)."
        )
    padded = torch.zeros(max(counts_list), dtype=torch.int64, device=device)
    padded[: local.numel()] = local
    rows = all_gather_equal(padded, dp_group)
    seqlens = [n for row, c in zip(rows, counts_list) for n in row[:c].tolist()]
    return GlobalLengths(seqlens=tuple(seqlens), counts=tuple(counts_list))


def collective_device(group: Optional[ProcessGroup]) -> torch.device:
    """Where tensors for collectives over ``group`` must live: this rank's GPU under NCCL, else
    the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_seqlens(local_seqlens: Sequence[int], dp_group: Optional[ProcessGroup]) -> list[int]:
    """Every length of the global batch, in global sample id order (DP-rank-major)."""
    return list(gather_lengths(local_seqlens, dp_group).seqlens)


def all_gather_equal(tensor: Tensor, group: Optional[ProcessGroup]) -> list[Tensor]:
    """Every rank's ``tensor`` (all of one shape), in group rank order."""
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, tensor, group=group)
    return rows
