"""Multi-latent attention from megatron's local modules under tensor parallelism: the CPU
backend's patch-table entry.

megatron-core 0.19.2's local MLA spec builds ``linear_kv_down_proj`` as a ``ColumnParallelLinear``:
each TP rank computes a slice of ``[kv latent | k_pos_emb]`` and ``get_query_key_value_tensors``
all-gathers it (``gather_from_tensor_model_parallel_region``, whose backward keeps this rank's
slice of the gradient). That is right for the latent, whose gradient arrives summed over TP
through ``linear_kv_up_proj``; but ``k_pos_emb`` is shared by every head and each TP rank holds
only its own heads, so its gradient is a per-rank part that nothing sums: the rank holding those
channels keeps its own heads' share and the other ranks' shares are lost (the down projection,
the input norm and everything before get wrong gradients; the loss is right). Transformer
Engine's spec builds the projection duplicated (``TELinear``) and sums that gradient through
sequence parallelism instead.

The entry gathers the projection's output itself, before megatron looks at it, so megatron takes
its full-width branch:

- without sequence parallelism the gather's backward sums the ``k_pos_emb`` channels of the
  gradient over TP, then keeps this rank's slice;
- with sequence parallelism the gathered tensor is scattered back over the sequence, and
  megatron's own full-width branch gathers ``k_pos_emb`` over the sequence, whose backward
  (reduce-scatter) sums the heads' shares.

``spec_refusals`` refuses MLA with TP > 1 on ``--transformer-impl local`` on a GPU, where the CPU
backend's entries are not applied.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Tuple

import torch
import torch.distributed as dist

from megatron_dcp.integration.patches.table import NO_CUDA, Patch


class _GatherLatentKV(torch.autograd.Function):
    """Forward: all-gather the TP slices of ``[kv latent | k_pos_emb]`` (last dimension).
    Backward: sum the last ``pos_dim`` channels of the gradient over TP, keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: Any, pos_dim: int) -> torch.Tensor:
        ctx.group, ctx.pos_dim = group, pos_dim
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        positional = grad[..., -ctx.pos_dim :].contiguous()
        dist.all_reduce(positional, group=ctx.group)
        grad[..., -ctx.pos_dim :] = positional
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None, None


def gathered_down_projection(original: Callable) -> Callable:
    """``MLASelfAttention._qkv_down_projection`` returning the whole ``[kv latent | k_pos_emb]``
    when the projection is column-parallel (module docstring); unchanged otherwise."""

    @functools.wraps(original)
    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = original(self, hidden_states)
        config = self.config
        if kv_combined.size(-1) == config.kv_lora_rank + config.qk_pos_emb_head_dim:
            return q_compressed, kv_combined
        from megatron.core.tensor_parallel.mappings import (
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        group = self.pg_collection.tp
        if config.sequence_parallel:
            full = gather_from_tensor_model_parallel_region(kv_combined, group)
            return q_compressed, scatter_to_sequence_parallel_region(full, group)
        full = _GatherLatentKV.apply(kv_combined, group, config.qk_pos_emb_head_dim)
        return q_compressed, full

    return _qkv_down_projection


MLA_TP_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "mla_local_kv_down_projection",
        "cpu_backend",
        ("megatron.core.transformer.multi_latent_attention:MLASelfAttention._qkv_down_projection",),
        "With the local spec's column-parallel linear_kv_down_proj and TP > 1, MLA all-gathers "
        "[kv latent | k_pos_emb] with a backward that keeps this rank's slice of the gradient, "
        "but each TP rank's k_pos_emb gradient covers only its own heads: the other ranks' "
        "shares are dropped (wrong gradients below the attention, the loss unchanged).",
        lambda owner, original: gathered_down_projection(original),
        when=NO_CUDA,
    ),
)
