"""The cost model: per-rank cost of one CP group in one micro-batch, in FLOP-equivalents.

``group_cost(seqlens, c)`` is what one rank of a CP group of ``c`` ranks spends on the sequences
``seqlens`` it packs in one micro-batch:

- ``c == 1``: ``Σ (a·L + b·L²)``;
- ``c > 1``: ``Σ (a·L + b·L²/η) / c + comm·(Σ L)·(c−1)/c + ring_step·(c−1)``.

``η`` (``cp_efficiency`` ≤ 1) is how well attention kernels keep their speed on ring chunks;
``comm`` is the exposed (not overlapped) cost of one token's K/V exchange; ``ring_step`` is the
fixed cost of one ring step (p2p latency, kernel launches), paid c−1 times per layer pass by a
group that holds a sample, once per micro-batch whatever it packs (the sequences of a THD pack
share the ring passes). ``per_rank(L, c)`` is one sequence's share without the ring term.

One object is built once and passed to every scheduler and to the simulator; nothing else
computes costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Optional

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
    ring_step: float = 0.0
    cp_efficiency: float = 1.0
    name: str = "custom"

    def __post_init__(self) -> None:
        values = (self.linear, self.quadratic, self.comm, self.ring_step)
        if min(values) < 0 or self.linear + self.quadratic <= 0:
            raise ValueError(f"cost model coefficients must be ≥ 0 with a+b > 0, got {self}")
        if not 0 < self.cp_efficiency <= 1:
            raise ValueError(f"cp_efficiency must be in (0, 1], got {self.cp_efficiency}")

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
        """Per-rank CP cost of one sequence on ``cp_size`` ranks beyond its share of the work:
        slower ring-chunk attention and the exposed K/V exchange (0 without CP)."""
        if cp_size <= 1:
            return 0.0
        slower = self.quadratic * seqlen * seqlen * (1.0 / self.cp_efficiency - 1.0)
        return (slower + self.comm * seqlen * (cp_size - 1)) / cp_size

    def per_rank(self, seqlen: int, cp_size: int) -> float:
        """One sequence's per-rank cost on a CP group of ``cp_size`` ranks, ring term excluded."""
        return self.work(seqlen) / cp_size + self.overhead(seqlen, cp_size)

    def ring_cost(self, cp_size: int) -> float:
        """The ring steps a non-empty CP group of ``cp_size`` ranks pays once per micro-batch."""
        return self.ring_step * (cp_size - 1) if cp_size > 1 else 0.0

    def group_cost(self, seqlens: Iterable[int], cp_size: int) -> float:
        """Per-rank cost of a CP group of ``cp_size`` ranks packing ``seqlens`` in one
        micro-batch (0 for an empty group)."""
        lengths = list(seqlens)
        if not lengths:
            return 0.0
        return sum(self.per_rank(n, cp_size) for n in lengths) + self.ring_cost(cp_size)


def latency_heavy(shape: Optional[ModelShape] = None) -> CostModel:
    """The model-shape coefficients with an expensive ring: one ring step costs 64 tokens of
    linear work and exposed K/V traffic 3 % of a token's linear work (a small, latency-bound
    model, or CP groups that cross nodes)."""
    base = CostModel.from_model_shape(shape)
    return replace(base, comm=0.03 * base.linear, ring_step=64.0 * base.linear, name="latency")


COST_MODELS = {
    "model": CostModel.from_model_shape,
    "attention": CostModel.attention_only,
    "latency": latency_heavy,
}


def build_cost_model(name: str = "model") -> CostModel:
    if name not in COST_MODELS:
        raise SchedulingError(
            "{cost_model}={name!r}: choose one of {names}.",
            name=name,
            names=", ".join(sorted(COST_MODELS)),
        )
    return COST_MODELS[name]()
