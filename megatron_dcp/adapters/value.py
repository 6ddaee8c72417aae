"""Value models (PPO critics) under DCP: the value-token alignment and the clipped value loss.

A critic's output at position ``t`` estimates the state after token ``t``, i.e. the value that
belongs to token ``t + 1`` (the right-shift of value models: token ``t``'s value is the output at
``t - 1``). Shifting a packed, zigzag-sharded tensor would move values across sequence
boundaries and CP chunk edges, so the shift is always made per sample, in the caller's order:

- training: :func:`to_state_positions` moves each sample's per-token targets (returns, old
  values, the response mask) one place left, *before* ``shard_per_token`` lays them out like
  the packed tokens, so position ``t`` of the model's output meets token ``t + 1``'s target;
- inference: ``merge_outputs`` restores every sample in order first, then
  :func:`values_of_tokens` moves each sample's outputs one place right.

The two are the same alignment; a sample's first token has no value (no state before it) and its
last position no target.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_dcp.adapters.heads import scalar_outputs
from megatron_dcp.adapters.loss import GradReduce, masked_mean_loss
from megatron_dcp.adapters.split import SplitBatch


def to_state_positions(values: Sequence[torch.Tensor], fill: float = 0) -> list[torch.Tensor]:
    """Per sample, token ``t + 1``'s entry at position ``t`` (the last position gets ``fill``):
    per-token targets moved to the positions of the critic outputs that predict them."""
    shifted = []
    for value in values:
        out = torch.full_like(value, fill)
        out[:-1] = value[1:]
        shifted.append(out)
    return shifted


def values_of_tokens(outputs: Sequence[torch.Tensor], fill: float = 0) -> list[torch.Tensor]:
    """Per sample (``merge_outputs``' order and lengths), token ``t``'s value: the output at
    ``t - 1``; token 0 gets ``fill``. Outputs ``[L, 1]`` become values ``[L]``; a wider head's
    ``[L, W]`` is refused (:func:`~megatron_dcp.adapters.heads.scalar_outputs`)."""
    values = []
    for index, output in enumerate(outputs):
        flat = scalar_outputs(output, 1, f"outputs[{index}]")
        out = torch.full_like(flat, fill)
        out[1:] = flat[:-1]
        values.append(out)
    return values


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    count: int,
    split: SplitBatch,
    clip_range: float = 0.2,
    grad_reduce: GradReduce = "sum",
) -> torch.Tensor:
    """This rank's share of PPO's clipped value loss over one micro-batch:
    ``(1/count) Σ mask · ½ max((v − R)², (v_old + clip(v − v_old, ±ε) − R)²)``.

    ``values``: the critic's output ``[1, T_local]`` or ``[1, T_local, 1]`` (a wider head is
    refused: :func:`~megatron_dcp.adapters.heads.scalar_outputs`); the other tensors are this
    micro-batch's shares (``shard_per_token``) of the per-sample targets after
    :func:`to_state_positions`; ``count`` is the mini-batch's response tokens in full (the mask's
    sum over every sample, computed on any rank: each holds the whole mini-batch)."""
    if clip_range <= 0:
        raise ValueError(f"clip_range={clip_range}: use a positive clip range (PPO's ε, e.g. 0.2)")
    values = scalar_outputs(values, 2, "values")
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return masked_mean_loss(per_token, mask, count, split, grad_reduce)
