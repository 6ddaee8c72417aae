"""Reference THD core attention with context parallelism, in pure torch.

The numerical oracle for the CP layouts and the attention of the CPU backend. Each rank holds its
zigzag share of every packed sequence (``runtime.packing``). K and V are all-gathered over the CP
group (backward: all-reduce of the gradient, then this rank's slice; works on gloo), put back in
global order, and every local query attends to the keys of its own sequence that are not later in
the sequence (causal in global positions) and are not padding. Slow (per-sequence dense scores)
but exact: the same arithmetic as a single process on the unsliced sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dcp.runtime.packing import local_token_indices, unzigzag


class _GatherTokens(torch.autograd.Function):
    """All-gather equal-length token shares (dim 0) over a group, in rank order. Backward:
    all-reduce the gradient of the gathered tensor and keep this rank's slice."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.length = local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.length
        return grad[start : start + ctx.length], None


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Size of a CP group; ``None`` means no CP (size 1)."""
    return 1 if group is None else dist.get_world_size(group)


def gather_sequence_tokens(
    local: torch.Tensor, cu_seqlens_padded: torch.Tensor, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """The global padded packed tensor (dim 0 = tokens) from every group rank's zigzag share."""
    size = group_size(group)
    if size == 1:
        return local
    gathered = _GatherTokens.apply(local, group)
    return unzigzag(list(gathered.chunk(size)), cu_seqlens_padded)


@dataclass(frozen=True)
class _Sequence:
    """One packed sequence as this rank sees it."""

    local_rows: torch.Tensor  # rows of the local q/output
    query_positions: torch.Tensor  # their positions in the sequence
    global_start: int  # first row of the sequence in the global padded layout
    padded_length: int
    real_length: int


def _sequences(
    cu_seqlens_padded: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int
) -> list[_Sequence]:
    """Where each sequence's local queries are and which global keys they may see."""
    global_rows = local_token_indices(cu_seqlens_padded, cp_size, cp_rank)
    padded_bounds = cu_seqlens_padded.tolist()
    real_bounds = cu_seqlens.tolist()
    sequences, offset = [], 0
    for index, (start, end) in enumerate(zip(padded_bounds[:-1], padded_bounds[1:])):
        count = (end - start) // cp_size
        rows = torch.arange(offset, offset + count)
        positions = global_rows[offset : offset + count] - start
        real = real_bounds[index + 1] - real_bounds[index]
        sequences.append(_Sequence(rows, positions, start, end - start, real))
        offset += count
    return sequences


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked softmax attention; ``query`` [sq, h, d], ``key``/``value`` [sk, h, d], ``mask``
    [sq, sk] (True = may attend). Rows with no allowed key give zeros instead of NaN."""
    compute = torch.promote_types(query.dtype, torch.float32)  # float64 stays float64
    scores = torch.einsum("qhd,khd->hqk", query.to(compute), key.to(compute)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1) * mask
    return torch.einsum("hqk,khd->qhd", probs, value.to(compute)).to(query.dtype)


def _repeat_kv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each of the K/V heads so there is one per query head (megatron's order)."""
    groups = tensor.shape[-2]
    if heads % groups != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of K/V heads ({groups})")
    return tensor if groups == heads else tensor.repeat_interleave(heads // groups, dim=-2)


def thd_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_group: Optional[dist.ProcessGroup] = None,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention over packed sequences, CP-sliced in the zigzag layout.

    ``query`` [T_local, h, d] or megatron's sbhd ``[T_local, 1, h, d]``; ``key``/``value`` the same
    with ``h_kv`` heads (GQA when fewer). ``cu_seqlens_padded`` / ``cu_seqlens`` are global (whole
    sequences); without ``cu_seqlens`` padded keys are not masked (they are never earlier than a
    real query, so only padded queries would see them). Returns ``[T_local, h*d]`` (or
    ``[T_local, 1, h*d]`` for sbhd input), like megatron's ``DotProductAttention``.
    """
    sbhd = query.dim() == 4
    if sbhd:
        if query.shape[1] != 1:
            raise ValueError(f"packed THD input needs batch size 1, got {query.shape[1]}")
        query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
    output = _thd_attention(
        query, key, value, cu_seqlens_padded, cu_seqlens, cp_group, softmax_scale
    )
    output = output.reshape(output.shape[0], -1)
    return output.unsqueeze(1) if sbhd else output


def _thd_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    cp_group: Optional[dist.ProcessGroup],
    softmax_scale: Optional[float],
) -> torch.Tensor:
    cu_seqlens_padded = cu_seqlens_padded.cpu()
    cu_seqlens = cu_seqlens_padded if cu_seqlens is None else cu_seqlens.cpu()
    scale = softmax_scale if softmax_scale is not None else query.shape[-1] ** -0.5
    cp_size = group_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    if query.shape[0] * cp_size != int(cu_seqlens_padded[-1]):
        raise ValueError(
            f"{query.shape[0]} local tokens on a CP group of {cp_size} do not match "
            f"cu_seqlens_padded[-1]={int(cu_seqlens_padded[-1])} (wrong CP group or layout?)"
        )
    full_key = _repeat_kv(gather_sequence_tokens(key, cu_seqlens_padded, cp_group), query.shape[1])
    full_value = _repeat_kv(
        gather_sequence_tokens(value, cu_seqlens_padded, cp_group), query.shape[1]
    )
    output = query.new_zeros(query.shape[0], query.shape[1], full_value.shape[-1])
    for seq in _sequences(cu_seqlens_padded, cu_seqlens, cp_size, cp_rank):
        keys = torch.arange(seq.padded_length)
        mask = (keys[None, :] <= seq.query_positions[:, None]) & (keys < seq.real_length)[None, :]
        rows = slice(seq.global_start, seq.global_start + seq.padded_length)
        local = seq.local_rows.to(query.device)
        attended = _attend(
            query[local], full_key[rows], full_value[rows], mask.to(query.device), scale
        )
        output = output.index_copy(0, local, attended)
    return output


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Plain causal attention, no packing and no CP: ``[s, b, h, d]`` in (``h_kv`` heads for K/V),
    ``[s, b, h*d]`` out. The un-packed single-process oracle."""
    scale = softmax_scale if softmax_scale is not None else query.shape[-1] ** -0.5
    seqlen = query.shape[0]
    positions = torch.arange(seqlen, device=query.device)
    mask = positions[None, :] <= positions[:, None]
    heads = query.shape[2]
    key, value = _repeat_kv(key, heads), _repeat_kv(value, heads)
    outputs = [
        _attend(query[:, b], key[:, b], value[:, b], mask, scale) for b in range(query.shape[1])
    ]
    return torch.stack(outputs, dim=1).reshape(seqlen, query.shape[1], -1)
