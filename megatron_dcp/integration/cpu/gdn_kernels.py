"""Reference Gated DeltaNet kernels in pure torch, for megatron's ``GatedDeltaNet`` on the CPU
backend.

megatron-core 0.19.2's ``GatedDeltaNet`` trains with three Triton kernels of
flash-linear-attention (fla), imported as None without it. These functions have the call
signatures megatron uses and compute the same mathematics in float32 (float64 stays float64),
with autograd:

- :func:`chunk_gated_delta_rule`: the gated delta rule in its recurrent form, per head, with
  state ``S`` (key dim × value dim) starting at zero::

      S ← exp(g_t) · S                        (decay)
      u_t = β_t · (v_t − Sᵀ k_t)              (the delta: what S predicts for k_t, corrected)
      S ← S + k_t u_tᵀ
      o_t = scale · Sᵀ q_t                    (scale defaults to key_dim^-0.5)

  fla's convention (its naive recurrent reference); megatron's ``torch_chunk_gated_delta_rule``
  computes the same in chunks. ``use_qk_l2norm_in_kernel`` normalises q and k first.
- :func:`causal_conv1d`: fla's short depthwise causal convolution on ``(batch, length,
  channels)``, optional SiLU, returning ``(out, None)``;
- :func:`l2norm`: ``x / sqrt(Σx² + eps)`` over the last dimension.

With ``cu_seqlens`` (packed THD sequences, batch 1) neither the state nor a convolution window
crosses a sequence boundary. The recurrence runs one token at a time: exact whatever chunk size
the GPU kernel uses, and meant for the short sequences of CPU runs. Initial and final states
(inference) are not supported. The patch table installs these only when CUDA is absent
(``integration.patches.cpu_backend``); on a GPU megatron calls fla's kernels.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from megatron_dcp.integration.cpu.mamba_kernels import causal_conv1d_fn


def l2norm(
    x: torch.Tensor,
    dim: int = -1,
    eps: float = 1e-6,
    output_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over ``dim``, computed in at least float32."""
    wide = _wide(x)
    out = wide * torch.rsqrt(wide.pow(2).sum(dim, keepdim=True) + eps)
    return out.to(output_dtype or x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    activation: Optional[str] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    **unused: Any,
) -> Tuple[torch.Tensor, None]:
    """``out[b, t, d] = bias[d] + Σ_j weight[d, j] · x[b, t − (width−1) + j, d]``, taps before the
    start of ``t``'s sequence read as zero; SiLU when ``activation`` is silu/swish. ``x``:
    ``(batch, length, channels)``; ``weight``: ``(channels, width)``."""
    _no_states(initial_state, output_final_state)
    if residual is not None:
        raise NotImplementedError("the reference causal_conv1d takes no residual")
    seq_idx = None
    if cu_seqlens is not None:
        seq_idx = sequence_index(cu_seqlens, x.shape[0], x.shape[1]).unsqueeze(0)
    out = causal_conv1d_fn(x.transpose(1, 2), weight, bias, seq_idx, activation=activation)
    return out.transpose(1, 2), None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **unused: Any,
) -> Tuple[torch.Tensor, None]:
    """The gated delta rule (module docstring). ``q``, ``k``: ``(batch, length, heads,
    key_dim)``; ``v``: ``(batch, length, heads, value_dim)``; ``g`` (log decay) and ``beta``:
    ``(batch, length, heads)``. Returns ``(o, None)``, ``o`` shaped and typed like ``v``."""
    _no_states(initial_state, output_final_state)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    starts = [0]
    if cu_seqlens is not None:
        sequence_index(cu_seqlens, q.shape[0], q.shape[1])  # checks the packing
        starts = [int(start) for start in cu_seqlens[:-1].tolist()]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = _recurrence(_wide(q) * scale, _wide(k), _wide(v), _wide(g), _wide(beta), set(starts))
    return out.to(v.dtype), None


def _recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: set,
) -> torch.Tensor:
    """The recurrence token by token, the state reset to zero at every sequence start."""
    batch, length, heads, key_dim = k.shape
    zero = k.new_zeros(batch, heads, key_dim, v.shape[-1])
    state, outputs = zero, []
    for t in range(length):
        if t in starts:
            state = zero
        state = state * g[:, t].exp()[..., None, None]
        key = k[:, t].unsqueeze(-2)  # (batch, heads, 1, key_dim)
        delta = beta[:, t, :, None] * (v[:, t] - (key @ state).squeeze(-2))
        state = state + key.transpose(-1, -2) * delta.unsqueeze(-2)
        outputs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outputs, dim=1)


def sequence_index(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Each token's sequence (``(length,)``) in a packed batch of one row whose sequences end at
    ``cu_seqlens[1:]``; a ValueError for anything else."""
    bounds: List[int] = [int(b) for b in cu_seqlens.tolist()]
    if batch != 1 or bounds[0] != 0 or bounds[-1] != length or bounds != sorted(bounds):
        raise ValueError(
            f"cu_seqlens {bounds} must rise from 0 to the packed length {length} of a batch of "
            f"one row (got batch {batch})"
        )
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or float64 when it is (the kernels compute in at least float32)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _no_states(initial: Optional[torch.Tensor], final: bool) -> None:
    if initial is not None or final:
        raise NotImplementedError(
            "the reference Gated DeltaNet kernels train from a zero state and return no final "
            "state (initial_state / output_final_state are for inference, which needs fla's "
            "kernels on a GPU)"
        )
