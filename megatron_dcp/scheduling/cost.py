"""The cost model: per-rank cost of one sequence on a CP group, in FLOP-equivalents.

``per_rank(L, c) = (a·L + b·L²) / c + overhead(L, c)`` with
``overhead(L, c) = comm·L·(c−1)/c`` for ``c > 1`` and 0 at ``c = 1``: each rank of a ring exchanges
the K/V of the other ``(c−1)/c`` of the sequence, and ``comm`` is the exposed (not overlapped) cost
of one token's K/V. The fixed latency of a ring step is paid once per CP group and micro-batch (all
sequences of a THD pack share the ring passes), not per sequence, so it is not part of this
per-sequence model. One object is built once and passed to every scheduler and to the simulator;
nothing else computes costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_dcp.scheduling.errors import SchedulingError


@dataclass(frozen=True)
class ModelShape:
    """The transformer dimensions that set the default cost coefficients (Llama-3-8B-like)."""

    hidden_size: int = 4096
    ffn_hidden_size: int = 14336
    num_layers: int = 32
    num_attention_heads: int = 32
    num_query_groups: int = 8
    vocab_size: int = 128256
    gated_mlp: bool = True

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads


# fwd + bwd ≈ 3× the forward FLOPs.
_TRAIN_FACTOR = 3.0
# Exposed FLOP-equivalents per byte moved between CP ranks: H100 bf16 dense peak (≈989 TFLOP/s)
# over NVLink (≈450 GB/s) is ≈2200; ring attention hides most of it behind compute.
_FLOPS_PER_BYTE = 2200.0
_EXPOSED_FRACTION = 0.5


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the per-rank cost; see the module docstring."""

    linear: float
    quadratic: float
    comm: float = 0.0
    name: str = "custom"

    def __post_init__(self) -> None:
        values = (self.linear, self.quadratic, self.comm)
        if min(values) < 0 or self.linear + self.quadratic <= 0:
            raise ValueError(f"cost model coefficients must be ≥ 0 with a+b > 0, got {self}")

    @classmethod
    def from_model_shape(cls, shape: Optional[ModelShape] = None) -> "CostModel":
        """Training FLOPs of a GPT with ``shape``: GEMMs per token, causal attention per token pair,
        and the exposed K/V exchange of ring attention (bf16)."""
        s = shape or ModelShape()
        kv_dim = s.num_query_groups * s.kv_channels
        mlp = (3 if s.gated_mlp else 2) * s.hidden_size * s.ffn_hidden_size
        per_layer = 2.0 * (s.hidden_size * (s.hidden_size + 2 * kv_dim) + s.hidden_size**2 + mlp)
        linear = _TRAIN_FACTOR * (s.num_layers * per_layer + 2.0 * s.hidden_size * s.vocab_size)
        # QKᵀ and AV: 4·h FLOPs per (query, key) pair, causal keeps half of the L² pairs.
        quadratic = _TRAIN_FACTOR * s.num_layers * 2.0 * s.hidden_size
        kv_bytes = s.num_layers * 2 * kv_dim * 2 * _TRAIN_FACTOR
        comm = kv_bytes * _FLOPS_PER_BYTE * _EXPOSED_FRACTION
        return cls(linear, quadratic, comm, name="model")

    @classmethod
    def attention_only(cls) -> "CostModel":
        """Pure attention work, ``L²/c``, no CP overhead: the model of the 0.19.2 hybrid-CP scheduler."""
        return cls(0.0, 1.0, name="attention")

    def work(self, seqlen: int) -> float:
        """Compute work of one sequence, summed over the ranks that share it (no overhead)."""
        return self.linear * seqlen + self.quadratic * seqlen * seqlen

    def overhead(self, seqlen: int, cp_size: int) -> float:
        """Per-rank CP cost of running ``seqlen`` on ``cp_size`` ranks (0 without CP)."""
        if cp_size <= 1:
            return 0.0
        return self.comm * seqlen * (cp_size - 1) / cp_size

    def per_rank(self, seqlen: int, cp_size: int) -> float:
        """Per-rank cost of one sequence of length ``seqlen`` on a CP group of ``cp_size`` ranks."""
        return self.work(seqlen) / cp_size + self.overhead(seqlen, cp_size)


COST_MODELS = {"model": CostModel.from_model_shape, "attention": CostModel.attention_only}


def build_cost_model(name: str = "model") -> CostModel:
    if name not in COST_MODELS:
        raise SchedulingError(
            "{cost_model}={name!r}: choose one of {names}.",
            name=name,
            names=", ".join(sorted(COST_MODELS)),
        )
    return COST_MODELS[name]()
