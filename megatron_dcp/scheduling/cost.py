"""The cost model: per-rank time of one CP group in one micro-batch.

``group_cost(seqlens, c)`` is what one rank of a CP group of ``c`` ranks spends on the sequences
``seqlens`` it packs in one micro-batch:

- ``c == 1``: ``Σ (a·L + b·L²)``;
- ``c > 1``: ``Σ (a·L + b·L²/η) / c + comm·(Σ L)·(c−1)/c + ring_step·(c−1)``;
- both plus ``spill · Σ max(0, L·L/c − spill_elements)``: attention that materialises each
  sequence's ``L/c × L`` score block per rank (the CPU backend's reference attention) slows down
  once the block leaves the cache (0 on GPU, where kernels never materialise scores);
- both plus ``sequence · n`` for the ``n`` sequences of the pack: what every rank of a group
  pays per sequence whatever its length, in layers that loop over a pack's sequences (on the
  CPU backend, megatron's unfused THD RoPE and the reference attention; 0 on GPU profiles,
  whose fused kernels take a whole pack at once);
- both plus ``vision · Σ P / c`` for vision-language samples: a sample's ``P`` encoder patches
  (its images' tiles × patches per tile) are encoded once per group, split evenly over its
  ``c`` ranks (0 for text, and with ``vision`` = 0 every cost is the text-only one, bit for bit).

``η`` (``cp_efficiency`` ≤ 1) is how well attention kernels keep their speed on ring chunks;
``comm`` is the exposed (not overlapped) cost of one token's K/V exchange; ``ring_step`` is the
fixed cost of one ring step (p2p latency, kernel launches), paid c−1 times per layer pass by a
group that holds a sample, once per micro-batch whatever it packs (the sequences of a THD pack
share the ring passes). ``per_rank(L, c)`` is one sequence's share without the ring term.
``microbatch`` is the fixed cost every rank pays per micro-batch (launches, Python, pipeline
hand-offs): it weighs the micro-batch count in the critical path.

With a node layout (``nodes``, a :class:`~megatron_dcp.scheduling.topology.NodeLayout`), a
group larger than ``nodes.node_size`` spans nodes: its ring runs at the inter-node tier, its
``comm`` and ``ring_step`` multiplied by the layout's factors (a ring is as slow as its slowest
link). Without one, every group is priced at the intra-node tier.

Coefficients built from a model and a hardware profile (:meth:`CostModel.from_model_shape`) or
fitted by ``megatron-dcp calibrate`` are in seconds; the scheduler only compares costs, so any
unit works. One object is built once and passed to every scheduler and to the simulator;
nothing else computes costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence, Tuple, Union

from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.hardware import (
    REFERENCE_GPU_PROFILE,
    HardwareProfile,
    hardware_profile,
)
from megatron_dcp.scheduling.model_shape import ModelShape
from megatron_dcp.scheduling.topology import NodeLayout


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the per-rank cost; see the module docstring."""

    linear: float
    quadratic: float
    comm: float = 0.0
    ring_step: float = 0.0
    cp_efficiency: float = 1.0
    name: str = "custom"
    microbatch: float = 0.0
    nodes: Optional[NodeLayout] = None
    spill: float = 0.0
    spill_elements: float = math.inf
    sequence: float = 0.0
    vision: float = 0.0  # seconds per encoder patch (a ViT's forward and backward)

    def __post_init__(self) -> None:
        values = (self.linear, self.quadratic, self.comm, self.ring_step, self.microbatch)
        values += (self.spill, self.spill_elements, self.sequence, self.vision)
        if min(values) < 0 or self.linear + self.quadratic <= 0:
            raise ValueError(f"cost model coefficients must be ≥ 0 with a+b > 0, got {self}")
        if not 0 < self.cp_efficiency <= 1:
            raise ValueError(f"cp_efficiency must be in (0, 1], got {self.cp_efficiency}")

    @classmethod
    def from_model_shape(
        cls, shape: Optional[ModelShape] = None, hardware: Optional[HardwareProfile] = None
    ) -> "CostModel":
        """Seconds per rank of training ``shape`` (default Llama-3-8B-like) on ``hardware``
        (default ``h100-nvlink``): GEMMs per token, causal attention per token pair, the exposed
        K/V exchange, the ring steps of every attention layer pass, every layer pass's fixed
        overhead per micro-batch, every attention layer pass's fixed cost per sequence, and the
        vision encoder's work per patch (0 without one)."""
        s = shape or ModelShape()
        hw = hardware or hardware_profile(REFERENCE_GPU_PROFILE)
        spill, spill_elements = 0.0, math.inf
        if hw.score_cache_bytes is not None and hw.score_spill_time > 0:
            spill = s.attention_passes() * s.heads_per_rank() * hw.score_spill_time
            spill_elements = hw.score_cache_bytes / (4 * s.heads_per_rank())
        return cls(
            linear=s.linear_flops() / (hw.peak_flops * hw.gemm_efficiency),
            quadratic=s.quadratic_flops() / (hw.peak_flops * hw.attention_efficiency),
            comm=s.kv_bytes(hw.bytes_per_element) / hw.link_bandwidth * hw.exposed_fraction,
            ring_step=s.ring_passes() * hw.ring_step_latency,
            cp_efficiency=hw.cp_efficiency,
            name=f"model@{hw.name}",
            microbatch=s.layer_passes() * hw.layer_pass_overhead,
            spill=spill,
            spill_elements=spill_elements,
            sequence=s.ring_passes() * hw.sequence_pass_overhead,
            vision=s.vision_linear_flops() / (hw.peak_flops * hw.gemm_efficiency)
            + s.vision_attention_flops() / (hw.peak_flops * hw.attention_efficiency),
        )

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
        comm = self.comm * self.nodes.comm_factor if self.crosses_nodes(cp_size) else self.comm
        return (slower + comm * seqlen * (cp_size - 1)) / cp_size

    def spilled(self, seqlen: int, cp_size: int) -> float:
        """Score elements of one sequence's block on one rank beyond what stays in cache."""
        return spilled_elements(seqlen, cp_size, self.spill_elements)

    def per_rank(self, seqlen: int, cp_size: int) -> float:
        """One sequence's per-rank cost on a CP group of ``cp_size`` ranks, ring term excluded
        (its fixed ``sequence`` cost included: every rank of the group pays it)."""
        cost = self.work(seqlen) / cp_size + self.overhead(seqlen, cp_size) + self.sequence
        return cost + self.spill * self.spilled(seqlen, cp_size) if self.spill else cost

    def sample_cost(self, seqlen: int, patches: int, cp_size: int) -> float:
        """:meth:`per_rank` of a sample with ``patches`` encoder patches: its share of the
        vision encoder's work, ``vision · patches / cp_size``, added (exactly ``per_rank``
        without patches or without a vision coefficient)."""
        cost = self.per_rank(seqlen, cp_size)
        if patches and self.vision:
            return cost + self.vision * patches / cp_size
        return cost

    def ring_cost(self, cp_size: int) -> float:
        """The ring steps a non-empty CP group of ``cp_size`` ranks pays once per micro-batch."""
        if cp_size <= 1:
            return 0.0
        step = (
            self.ring_step * self.nodes.ring_factor
            if self.crosses_nodes(cp_size)
            else self.ring_step
        )
        return step * (cp_size - 1)

    def crosses_nodes(self, cp_size: int) -> bool:
        """True when a group of ``cp_size`` ranks spans nodes (always False without a layout)."""
        return self.nodes is not None and self.nodes.crosses(cp_size)

    def with_nodes(self, nodes: Optional[NodeLayout]) -> "CostModel":
        """The same coefficients priced over the node layout ``nodes`` (None: one tier)."""
        return replace(self, nodes=nodes)

    def group_cost(
        self, seqlens: Iterable[int], cp_size: int, patches: Optional[Iterable[int]] = None
    ) -> float:
        """Per-rank cost of a CP group of ``cp_size`` ranks packing ``seqlens`` in one
        micro-batch (0 for an empty group); ``patches``: each sample's encoder patches (None:
        none), whose vision work the group's ranks share (:meth:`sample_cost`)."""
        lengths = list(seqlens)
        if not lengths:
            return 0.0
        if patches is None:
            return sum(self.per_rank(n, cp_size) for n in lengths) + self.ring_cost(cp_size)
        pairs = zip(lengths, patches, strict=True)  # one count per sequence
        costs = (self.sample_cost(n, p, cp_size) for n, p in pairs)
        return sum(costs) + self.ring_cost(cp_size)


# What prices a sample: its length, or (length, encoder patches) for one with patches.
CostKey = Union[int, Tuple[int, int]]


class SizeCosts(dict):
    """Per-rank costs (:meth:`CostModel.sample_cost`) on CP groups of one size keyed by the
    sample's cost key (:func:`cost_keys`: its length, or ``(length, patches)`` for a sample
    with vision work), computed on first use: the hot path of planning and pricing, one table
    per size looked up by an int for text (a batch repeats lengths; the values are the cost
    model's own, bit for bit)."""

    def __init__(self, cost: CostModel, size: int) -> None:
        super().__init__()
        self.cost, self.size = cost, size

    def __missing__(self, key: CostKey) -> float:
        if key.__class__ is tuple:
            value = self[key] = self.cost.sample_cost(key[0], key[1], self.size)
        else:
            value = self[key] = self.cost.per_rank(key, self.size)
        return value


def cost_keys(
    seqlens: Sequence[int], patches: Sequence[int], cost: CostModel
) -> Sequence[CostKey]:
    """Each sample's cost key: its length when it has no encoder patches (or the cost model
    no ``vision`` coefficient: then ``seqlens`` itself, the same object), ``(length, patches)``
    otherwise. Samples of one key cost the same on every CP size."""
    if not patches or not cost.vision or not any(patches):
        return seqlens
    return tuple(n if not p else (n, p) for n, p in zip(seqlens, patches))


def key_length(key: CostKey) -> int:
    """The length a cost key holds."""
    return key[0] if key.__class__ is tuple else key


def key_patches(key: CostKey) -> int:
    """The encoder patches a cost key holds (0 for a length)."""
    return key[1] if key.__class__ is tuple else 0


def spilled_elements(seqlen: int, cp_size: int, cached: float) -> float:
    """Elements of one sequence's ``L/c × L`` score block on one rank beyond the ``cached`` ones."""
    return max(0.0, seqlen * seqlen / cp_size - cached)


def latency_heavy(shape: Optional[ModelShape] = None) -> CostModel:
    """The model-shape coefficients with an expensive ring: one ring step costs 64 tokens of
    linear work and exposed K/V traffic 3 % of a token's linear work (a small, latency-bound
    model, or CP groups that cross nodes)."""
    base = CostModel.from_model_shape(shape)
    return replace(base, comm=0.03 * base.linear, ring_step=64.0 * base.linear, name="latency")


def cpu_backend(shape: Optional[ModelShape] = None) -> CostModel:
    """The model-shape coefficients on the CPU backend's profile (``cpu-gloo``): the world where
    each sequence of a pack has its fixed cost (``sequence``) and score blocks spill."""
    base = CostModel.from_model_shape(shape, hardware_profile("cpu-gloo"))
    return replace(base, name="cpu")


COST_MODELS = {
    "model": lambda: replace(CostModel.from_model_shape(), name="model"),
    "attention": CostModel.attention_only,
    "latency": latency_heavy,
    "cpu": cpu_backend,
}


def build_cost_model(name: str = "model") -> CostModel:
    if name not in COST_MODELS:
        raise SchedulingError(
            "{cost_model}={name!r}: choose one of {names}.",
            name=name,
            names=", ".join(sorted(COST_MODELS)),
        )
    return COST_MODELS[name]()
