"""The item every variable-length dataset yields (:data:`Sample`, built by :func:`make_sample`)
and what the mock and indexed datasets share: stable seeds, index checks, megatron's ``Split``."""

from __future__ import annotations

import hashlib
from typing import Any, Dict

import torch

Sample = Dict[str, torch.Tensor]


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


def make_sample(sequence: torch.Tensor) -> Sample:
    """The item of a sequence of L+1 tokens: inputs, next-token labels, mask and length."""
    tokens, labels = sequence[:-1].clone(), sequence[1:].clone()
    length = tokens.numel()
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones(length, dtype=torch.float32),
        "length": torch.tensor(length, dtype=torch.int64),
    }
