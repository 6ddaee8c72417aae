"""Loss normalisation for per-token losses on a split mini-batch (derivation: docs/rl.md).

Goal: the gradient of the token-mean loss over the whole mini-batch,
``∇ (1/T) Σ_{loss tokens t} ℓ_t``, whatever the CP groups and micro-batches. Each rank sums its
own tokens' losses (its zigzag chunks: every token is on exactly one rank of the domain), scales
by ``1/T`` with ``T`` the mini-batch's token count (each token once, not once per CP sibling), and
the DP×CP gradient all-reduce sums the ranks' contributions.
"""

from __future__ import annotations

from typing import Literal

import torch

from megatron_dcp.adapters.split import RankMicroBatch, SplitBatch

GradReduce = Literal["sum", "mean"]


def token_mean_scale(
    num_tokens: int, domain_size: int = 1, grad_reduce: GradReduce = "sum"
) -> float:
    """The factor for each rank's summed per-token loss so that the gradient after the DP×CP
    all-reduce is that of the token mean over ``num_tokens`` tokens.

    ``grad_reduce="sum"``: the all-reduce sums (a plain all-reduce; megatron DDP with
    ``calculate_per_token_loss``): ``1/T``. ``"mean"``: it averages over the ``domain_size``
    ranks (megatron DDP's default): ``N/T``. A mini-batch without loss tokens gives 0.
    """
    if grad_reduce not in ("sum", "mean"):
        raise ValueError(
            f"grad_reduce={grad_reduce!r}: use 'sum' or 'mean' (what the DP×CP "
            "gradient all-reduce does)"
        )
    if num_tokens < 0 or domain_size < 1:
        raise ValueError(
            f"num_tokens={num_tokens}, domain_size={domain_size}: need num_tokens >= 0 (the "
            "mini-batch's loss tokens) and domain_size >= 1 (DP×CP ranks)"
        )
    if num_tokens == 0:
        return 0.0
    return (domain_size if grad_reduce == "mean" else 1) / num_tokens


def split_loss_scale(split: SplitBatch, grad_reduce: GradReduce = "sum") -> float:
    """:func:`token_mean_scale` for a split mini-batch (its token count and domain size)."""
    return token_mean_scale(split.num_tokens, split.plan.domain.size, grad_reduce)


def token_mean_loss(
    per_token_loss: torch.Tensor,
    microbatch: RankMicroBatch,
    split: SplitBatch,
    grad_reduce: GradReduce = "sum",
) -> torch.Tensor:
    """This rank's contribution to the mini-batch token-mean loss from one micro-batch:
    ``Σ loss_mask·ℓ × scale``; call ``backward()`` on it (or on the sum over micro-batches).
    ``per_token_loss`` is ``[1, T_local]`` (the model's per-token loss on ``microbatch``)."""
    return masked_mean_loss(
        per_token_loss, microbatch.packed.loss_mask, split.num_tokens, split, grad_reduce
    )


def masked_mean_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    count: int,
    split: SplitBatch,
    grad_reduce: GradReduce = "sum",
) -> torch.Tensor:
    """This rank's contribution to ``(1/count) Σ mask·ℓ`` over the whole mini-batch, for a mask
    of its own: ``mask`` is this rank's share of it (``shard_per_token``, ``[1, T_local]``) and
    ``count`` the mini-batch's weight in full (e.g. its response tokens, or its samples for a
    score read at one token per sample). Every token of the micro-batch stays in the graph, so
    a rank whose mask is all zeros still runs its CP group's backward collectives."""
    if per_token_loss.shape != mask.shape:
        raise ValueError(
            f"per_token_loss has shape {tuple(per_token_loss.shape)}; expected {tuple(mask.shape)}"
            " (the micro-batch's local tokens, [1, T_local])"
        )
    scale = token_mean_scale(count, split.plan.domain.size, grad_reduce)
    return (per_token_loss.float() * mask.to(per_token_loss.device)).sum() * scale
