"""Reference Mamba-2 kernels in pure torch, for megatron's Mamba mixer on the CPU backend.

megatron-core 0.19.2's ``MambaMixer`` trains with CUDA kernels from ``mamba_ssm`` (the fused
conv + SSD scan, the gated RMSNorm) and ``causal_conv1d``. These functions have the call
signatures megatron uses and compute the same mathematics exactly, in float32 (float64 stays
float64), with autograd:

- :func:`causal_conv1d_fn`: depthwise causal conv1d (``x`` is ``(batch, channels, length)``),
  optional SiLU;
- :func:`mamba_chunk_scan_combined`: the SSD scan ``h_t = exp(dt_t·A)·h_{t-1} + dt_t·x_t·B_tᵀ``,
  ``y_t = h_t·C_t + D·x_t`` (per head; B and C shared by the heads of a group), with ``dt_bias``,
  softplus and the ``dt_limit`` clamp, and the optional SiLU(z) gate;
- :func:`mamba_split_conv1d_scan_combined`: split ``zxbcdt`` into z, xBC and dt, conv + SiLU on
  xBC, then the scan, then the optional gated RMSNorm and output projection;
- :class:`RMSNormGated`: RMSNorm per group of ``group_size`` channels, gated by SiLU(z) before
  or after the norm.

Every kernel honours ``seq_idx`` (each token's sequence in a packed batch): neither the conv
window nor the SSM state crosses a sequence boundary. The scan is computed in its quadratic
("attention") form per batch row, O(length²) memory per head: exact whatever ``chunk_size`` is,
and meant for the short sequences of CPU runs. ``initial_states`` and final states (inference)
are not supported. The GPU path uses the real packages; the patch table installs these only
when CUDA is absent (``integration.patches.cpu_backend``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

SILU = ("silu", "swish")
NO_LIMIT = (0.0, float("inf"))


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
    final_states_out: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """``out[b, d, t] = bias[d] + Σ_k weight[d, k] · x[b, d, t - (width-1) + k]``, taps before
    the start of ``t``'s sequence read as zero; SiLU when ``activation`` is silu/swish."""
    _no_states(initial_states, return_final_states or final_states_out is not None)
    width, length = weight.shape[-1], x.shape[-1]
    out = torch.zeros_like(_up(x))
    for tap in range(width):
        shift = width - 1 - tap
        if shift >= length:
            continue
        shifted = F.pad(_up(x), (shift, 0))[..., :length]
        if seq_idx is not None and shift:
            same = seq_idx[:, shift:] == seq_idx[:, :-shift]
            keep = F.pad(same, (shift, 0), value=False).unsqueeze(1)
            shifted = shifted * keep
        out = out + _up(weight[:, tap]).unsqueeze(-1) * shifted
    if bias is not None:
        out = out + _up(bias).unsqueeze(-1)
    if activation in SILU:
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(
            f"causal_conv1d_fn: activation must be None, 'silu' or 'swish', got {activation!r}"
        )
    return out.to(x.dtype)


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    initial_states: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    dt_limit: Tuple[float, float] = NO_LIMIT,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> torch.Tensor:
    """The SSD scan (module docstring). ``x``/``z``: ``(batch, length, heads, headdim)``;
    ``dt``: ``(batch, length, heads)``; ``A``: ``(heads,)``; ``B``/``C``: ``(batch, length,
    groups, state)``; ``D``: ``(heads,)`` or ``(heads, headdim)``. ``chunk_size`` does not
    change the result here (exact computation)."""
    _no_states(initial_states, return_final_states or return_varlen_states)
    dt = _processed_dt(dt, dt_bias, dt_softplus, dt_limit)
    y = _ssd(_up(x), dt, _up(A), _up(B), _up(C), seq_idx)
    if D is not None:
        y = y + _up(x) * (_up(D).unsqueeze(-1) if D.dim() == 1 else _up(D))
    if z is not None:
        y = y * F.silu(_up(z))
    return y.to(x.dtype)


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: Optional[torch.Tensor],
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: Optional[torch.Tensor] = None,
    seq_idx: Optional[torch.Tensor] = None,
    dt_limit: Tuple[float, float] = NO_LIMIT,
    return_final_states: bool = False,
    activation: str = "silu",
    rmsnorm_weight: Optional[torch.Tensor] = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Optional[torch.Tensor] = None,
    outproj_bias: Optional[torch.Tensor] = None,
    headdim: Optional[int] = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """``zxbcdt`` ``(batch, length, 2·dim + 2·ngroups·state + heads)`` -> ``(batch, length,
    dim)`` (or the output projection's width): module docstring."""
    _no_states(initial_states, return_final_states)
    heads = dt_bias.shape[0]
    headdim = D.shape[-1] if D.dim() == 2 else headdim
    dim = heads * headdim
    state = (conv1d_weight.shape[0] - dim) // ngroups // 2
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * state, heads], dim=-1)
    xbc = causal_conv1d_fn(
        xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, activation=activation
    ).transpose(1, 2)
    x, b, c = torch.split(xbc, [dim, ngroups * state, ngroups * state], dim=-1)
    batch, length = x.shape[:2]
    y = mamba_chunk_scan_combined(
        x.reshape(batch, length, heads, headdim),
        dt,
        A,
        b.reshape(batch, length, ngroups, state),
        c.reshape(batch, length, ngroups, state),
        chunk_size,
        D=D,
        z=None if rmsnorm_weight is not None else z.reshape(batch, length, heads, headdim),
        dt_bias=dt_bias,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=dt_limit,
    ).reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        y = gated_rms_norm(y, rmsnorm_weight, z, rmsnorm_eps, dim // ngroups, norm_before_gate)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return y


def gated_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: Optional[torch.Tensor],
    eps: float,
    group_size: Optional[int],
    norm_before_gate: bool,
) -> torch.Tensor:
    """RMSNorm over each group of ``group_size`` channels (all channels when None), times
    ``weight``; gated by SiLU(z) after the norm (``norm_before_gate``) or before it."""
    dtype, x = x.dtype, _up(x)
    gate = F.silu(_up(z)) if z is not None else None
    if gate is not None and not norm_before_gate:
        x = x * gate
    size = group_size or x.shape[-1]
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = normed.reshape(x.shape) * _up(weight)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(dtype)


class RMSNormGated(torch.nn.Module):
    """``mamba_ssm``'s gated RMSNorm module: ``forward(x, z=None)`` (see :func:`gated_rms_norm`)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: Optional[int] = None,
        norm_before_gate: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return gated_rms_norm(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate)


class ShardedRMSNormGated(RMSNormGated):
    """What megatron's ``ExtendedRMSNorm`` adds to the gated norm: its weight sharded over TP
    along axis 0 in a distributed checkpoint (megatron defines that class over a MagicMock when
    mamba_ssm is absent, so it is provided here)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tp_group = getattr(self, "tp_group", None)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=tp_group or parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )


def _processed_dt(
    dt: torch.Tensor,
    dt_bias: Optional[torch.Tensor],
    softplus: bool,
    limit: Sequence[float],
) -> torch.Tensor:
    dt = _up(dt)
    if dt_bias is not None:
        dt = dt + _up(dt_bias)
    if softplus:
        dt = F.softplus(dt)
    if tuple(limit) != NO_LIMIT:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def _ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    seq_idx: Optional[torch.Tensor],
) -> torch.Tensor:
    """``y[t] = Σ_{s ≤ t, same sequence} (C_t·B_s) · exp(Σ_{s<r≤t} dt_r·A) · dt_s · x_s``: the
    scan unrolled."""
    heads, groups = x.shape[2], B.shape[2]
    if heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of ngroups ({groups})")
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    cumulative = torch.cumsum(dt * A, dim=1)  # (batch, length, heads)
    exponent = cumulative.unsqueeze(2) - cumulative.unsqueeze(1)  # (batch, t, s, heads)
    visible = _visible(x.shape[1], seq_idx, x.device).unsqueeze(-1)
    decay = torch.exp(exponent.masked_fill(~visible, -math.inf))
    scores = torch.einsum("bthn,bshn->btsh", C, B) * decay * dt.unsqueeze(1)
    return torch.einsum("btsh,bshp->bthp", scores, x)


def _visible(length: int, seq_idx: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``(batch or 1, t, s)``: s ≤ t and, with ``seq_idx``, in the same sequence."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril().unsqueeze(0)
    if seq_idx is None:
        return causal
    return causal & (seq_idx.unsqueeze(2) == seq_idx.unsqueeze(1))


def _up(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or float64 when it is (the kernels compute in at least float32)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _no_states(initial: Optional[torch.Tensor], final: bool) -> None:
    if initial is not None or final:
        raise NotImplementedError(
            "the reference Mamba kernels train from a zero state and return no final state "
            "(initial_states / return_final_states are for inference, which needs the CUDA kernels)"
        )
