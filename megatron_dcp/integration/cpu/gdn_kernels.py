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
crosses a sequence boundary. The recurrence is computed exactly, :data:`CHUNK` tokens at a time:
inside a chunk it unrolls into a unit lower triangular system for the deltas (``_chunk``), and the
state carries from chunk to chunk, so its result does not depend on the chunk size (the tests
compare it with the token-by-token recurrence). Initial and final states (inference) are not
supported. The patch table installs these only when CUDA is absent
(``integration.patches.cpu_backend``); on a GPU megatron calls fla's kernels.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch

from megatron_dcp.integration.cpu.mamba_kernels import causal_conv1d_fn

CHUNK = 64  # tokens per triangular solve (the result does not depend on it)


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
    batch, length = q.shape[:2]
    bounds = [0, length]
    if cu_seqlens is not None:
        sequence_index(cu_seqlens, batch, length)  # checks the packing
        bounds = [int(bound) for bound in cu_seqlens.tolist()]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    inputs = (_wide(q) * scale, _wide(k), _wide(v), _wide(g), _wide(beta))
    rows = []
    for row in range(batch):
        sequences = [
            _sequence([x[row, start:end].transpose(0, 1) for x in inputs])
            for start, end in zip(bounds[:-1], bounds[1:])
            if end > start
        ]
        rows.append(torch.cat(sequences, dim=1).transpose(0, 1))
    return torch.stack(rows).to(v.dtype), None


def _sequence(inputs: List[torch.Tensor]) -> torch.Tensor:
    """One sequence, heads first (``q``, ``k``: ``(heads, length, key_dim)``, ``v``: ``(heads,
    length, value_dim)``, ``g``, ``beta``: ``(heads, length)``), from a zero state, chunk by
    chunk; the output ``(heads, length, value_dim)``."""
    q, k, v, g, beta = inputs
    state = k.new_zeros(k.shape[0], k.shape[-1], v.shape[-1])
    outputs = []
    for start in range(0, k.shape[1], CHUNK):
        chunk = [x[:, start : start + CHUNK] for x in (q, k, v, g, beta)]
        out, state = _chunk(*chunk, state)
        outputs.append(out)
    return torch.cat(outputs, dim=1)


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over one chunk of c tokens, exactly, from ``state`` (heads, key, value).
    With Γ_t = Σ_{j≤t} g_j inside the chunk, the recurrence unrolls to
    ``S_t = e^{Γ_t}·S + Σ_{j≤t} e^{Γ_t−Γ_j}·k_j u_jᵀ``, so the deltas u solve the unit lower
    triangular system ``u_t + β_t Σ_{j<t} e^{Γ_t−Γ_j}(k_t·k_j) u_j = β_t (v_t − e^{Γ_t} Sᵀk_t)``
    and ``o_t = e^{Γ_t} Sᵀq_t + Σ_{j≤t} e^{Γ_t−Γ_j}(q_t·k_j) u_j``."""
    size = k.shape[1]
    cumulative = g.cumsum(-1)  # (heads, c)
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    exponent = cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)  # (heads, t, j)
    decay = exponent.masked_fill(~causal, -math.inf).exp()  # zero above the diagonal
    start_decay = cumulative.exp().unsqueeze(-1)  # (heads, c, 1)
    system = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay
    target = beta.unsqueeze(-1) * (v - start_decay * (k @ state))
    deltas = torch.linalg.solve_triangular(system, target, upper=False, unitriangular=True)
    out = start_decay * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ deltas
    to_end = (cumulative[:, -1:] - cumulative).exp().unsqueeze(-1)  # e^{Γ_c − Γ_j}
    state = cumulative[:, -1].exp()[:, None, None] * state + (k * to_end).transpose(-1, -2) @ deltas
    return out, state


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
