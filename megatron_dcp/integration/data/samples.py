"""The item every variable-length dataset yields (:data:`Sample`, built by :func:`make_sample`)
and what the datasets share: stable seeds, index checks, the seeded order of passes over
documents or conversations, megatron's ``Split``."""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

Sample = Dict[str, torch.Tensor]
_LOG = logging.getLogger(__name__)
_REPORTED: set = set()  # (source, --seq-length) pairs whose truncation this process logged


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from the parts; stable across processes (no ``hash()``)."""
    text = ":".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def megatron_split(name: str) -> Any:
    """megatron's ``Split`` enum member for 'train'/'valid'/'test'. Datasets carry it as
    ``.split`` because megatron's ``build_pretraining_data_loader`` reads it to pick the eval
    micro-batch size and the full-validation sampler."""
    from megatron_dcp.integration.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core.datasets.utils import Split

    return Split[name]


def check_index(index: int, size: int) -> int:
    """``index`` as an int; IndexError outside ``[0, size)``."""
    if not 0 <= index < size:
        raise IndexError(f"sample index {index} is outside [0, {size})")
    return int(index)


@functools.lru_cache(maxsize=4)
def _permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    """The order of one pass (epoch) over ``size`` documents or conversations."""
    return np.random.default_rng(stable_seed("varlen-documents", seed, epoch)).permutation(size)


def pass_position(index: int, num_samples: int, size: int, seed: Any) -> int:
    """The position in ``[0, size)`` that sample ``index`` reads: passes repeat over the ``size``
    items in a fresh seeded permutation each (in order when ``seed`` is None)."""
    epoch, position = divmod(check_index(index, num_samples), size)
    if seed is None:
        return position
    return int(_permutation(size, seed, epoch)[position])


def make_sample(sequence: torch.Tensor, prompt: int = 0) -> Sample:
    """The item of a sequence of L+1 tokens: inputs, next-token labels, mask and length. The first
    ``prompt`` labels are outside the loss (mock data's stand-in for an SFT prompt); 0 leaves
    every label in it."""
    tokens, labels = sequence[:-1].clone(), sequence[1:].clone()
    length = tokens.numel()
    loss_mask = torch.ones(length, dtype=torch.float32)
    loss_mask[:prompt] = 0.0
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "length": torch.tensor(length, dtype=torch.int64),
    }


def report_truncation(source: str, lengths: np.ndarray, seq_length: int) -> None:
    """Log how many of ``source``'s sequence ``lengths`` exceed ``--seq-length`` and are
    truncated to it, and by how much: once per source and length (on rank 0 when distributed),
    and only when some sequence is longer."""
    over = lengths[lengths > seq_length] - seq_length
    if over.size == 0:
        return
    message = (
        f"{source}: {over.size:,} of {lengths.size:,} sequences are longer than --seq-length "
        f"{seq_length} and are truncated to it ({int(over.sum()):,} tokens dropped, longest "
        f"{seq_length + int(over.max()):,})"
    )
    if (source, seq_length) not in _REPORTED and first_rank():
        _LOG.warning(message)
    _REPORTED.add((source, seq_length))


def first_rank() -> bool:
    """This process is rank 0, or not distributed (it logs for everyone)."""
    return not dist.is_initialized() or dist.get_rank() == 0
