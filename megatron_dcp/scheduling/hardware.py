"""Hardware profiles: what turns a model's FLOPs and bytes into seconds.

A :class:`HardwareProfile` holds per-GPU (or per-CPU-rank) rates and latencies; together with a
:class:`~megatron_dcp.scheduling.model_shape.ModelShape` it gives a
:class:`~megatron_dcp.scheduling.cost.CostModel` in seconds (:meth:`~megatron_dcp.scheduling.cost.CostModel.from_model_shape`). The values
are a-priori estimates, each with its source below; ``megatron-dcp calibrate`` measures the real
ones, and online refinement corrects them while training runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

from megatron_dcp.scheduling.errors import SchedulingError


@dataclass(frozen=True)
class HardwareProfile:
    """Rates of one rank and of the links between the ranks of a CP group."""

    name: str
    # Dense peak FLOP/s of one rank in the training precision.
    peak_flops: float
    # Fraction of the peak that GEMMs (linear work) and attention kernels (L² work) reach.
    gemm_efficiency: float
    attention_efficiency: float
    # Bytes/s one rank sends to its ring neighbour, and the fraction of that traffic that
    # computation does not hide.
    link_bandwidth: float
    exposed_fraction: float
    # Seconds one ring step of one layer pass costs whatever it carries (p2p latency, the
    # launches of the partial-attention and correction kernels).
    ring_step_latency: float
    # Seconds of fixed cost per layer pass of a micro-batch (kernel launches, Python).
    layer_pass_overhead: float
    # CP attention speed relative to whole-sequence attention (smaller ring chunks).
    cp_efficiency: float = 1.0
    bytes_per_element: int = 2
    # Attention that materialises its scores (the CPU backend's reference attention): bytes of
    # fp32 scores of one sequence's block (all heads of a rank) that stay in cache, and the
    # seconds each score element of one head beyond them adds to one layer's forward and
    # backward. None / 0: kernels that never materialise scores (flash attention on GPU).
    score_cache_bytes: Optional[float] = None
    score_spill_time: float = 0.0
    # The same two for a ring step that crosses a node boundary (None: as inside a node).
    inter_node_link_bandwidth: Optional[float] = None
    inter_node_ring_step_latency: Optional[float] = None
    # Seconds each sequence of a pack adds to one attention layer pass (forward or backward)
    # whatever its length: layers that loop over the pack's sequences. 0: kernels that take the
    # whole pack at once (Transformer Engine's THD attention and fused RoPE).
    sequence_pass_overhead: float = 0.0

    def inter_node_factors(self) -> Tuple[float, float]:
        """How many times more a CP group that spans nodes pays for its exposed K/V exchange
        (the bandwidth ratio) and for each ring step (the latency ratio) than one inside a node."""
        bandwidth = self.inter_node_link_bandwidth or self.link_bandwidth
        latency = self.inter_node_ring_step_latency or self.ring_step_latency
        return self.link_bandwidth / bandwidth, latency / self.ring_step_latency

    def with_links(
        self,
        link_bandwidth: Optional[float] = None,
        inter_node_link_bandwidth: Optional[float] = None,
    ) -> "HardwareProfile":
        """This profile with the measured bandwidths of its two link tiers (None: keep the
        profile's). An inter-node tier the profile leaves out follows a new intra-node one."""
        values = {}
        if link_bandwidth is not None:
            values["link_bandwidth"] = link_bandwidth
        if inter_node_link_bandwidth is not None:
            values["inter_node_link_bandwidth"] = inter_node_link_bandwidth
        return replace(self, **values) if values else self


HARDWARE_PROFILES: Dict[str, HardwareProfile] = {
    # H100 SXM with NVLink 4, bf16:
    # - peak 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet);
    # - GEMMs at 50 % of peak: the MFU Megatron-Core reports for Llama-class models on H100;
    # - attention at 40 %: FlashAttention fwd+bwd throughput on H100 (≈ 350–450 TFLOP/s);
    # - 450 GB/s per direction (NVLink 4: 900 GB/s bidirectional), half of the K/V exchange
    #   exposed: ring attention overlaps each step's transfer with the previous chunk;
    # - 15 µs per ring step: NCCL p2p latency on NVLink (≈ 8 µs) plus the launches of the
    #   chunk-attention and softmax-correction kernels (≈ 3 µs each);
    # - 10 µs per layer pass: launch overhead of a layer's kernels outside CUDA graphs;
    # - ring chunks run at 95 % of the speed of whole-sequence attention (shorter tiles);
    # - across nodes, 50 GB/s per GPU: one 400 Gb/s InfiniBand NDR adapter per GPU (DGX H100:
    #   8 ConnectX-7 per node), 9× less than NVLink;
    # - 35 µs per ring step across nodes: an NCCL p2p message over InfiniBand with GPUDirect
    #   RDMA (≈ 25 µs through NCCL's network proxy) plus the same two kernel launches.
    "h100-nvlink": HardwareProfile(
        name="h100-nvlink",
        peak_flops=989e12,
        gemm_efficiency=0.5,
        attention_efficiency=0.4,
        link_bandwidth=450e9,
        exposed_fraction=0.5,
        ring_step_latency=15e-6,
        layer_pass_overhead=10e-6,
        cp_efficiency=0.95,
        inter_node_link_bandwidth=50e9,
        inter_node_ring_step_latency=35e-6,
    ),
    # The CPU backend of this project (gloo, fp32, one thread per rank), measured by
    # `megatron-dcp calibrate` on the project's 2-core machine (2 layers, hidden 128, FFN 512,
    # 2 ranks; docs/cost_model.md has the run):
    # - peak 96 GFLOP/s: one AVX2 core's fp32 FMA peak (2 FMA units × 8 lanes × 2 FLOPs × 3 GHz);
    #   GEMMs reached 54 GFLOP/s (56 %);
    # - attention 16 GFLOP/s (17 %) while a sequence's scores stay in cache (the reference
    #   attention materialises L×L scores; 47 ns per element of 4 heads × 32 dims, forward and
    #   backward, up to 1024²); the calibrated 7.4 GFLOP/s averaged in the spilled sizes;
    # - 0.22 GB/s for K/V through gloo, nothing hidden (K/V are gathered before attention);
    # - 4 ms per CP step of a layer pass and 2 ms per layer pass: gloo round trips and the Python
    #   and autograd dispatch of a small layer dominate on CPU;
    # - no second tier: the ranks of this machine talk over loopback, wherever a "node" ends;
    # - score spill: the reference attention's forward + backward costs ~47 ns per score element
    #   (4 heads) while a sequence's scores stay under ~16 MiB, ~120 ns beyond 64 MiB (the 32 MiB
    #   L3 that both cores share): 19 ns per element of one head beyond 16 MiB
    #   (docs/performance.md, "The missing term");
    # - 0.49 ms per sequence and attention layer pass: megatron's unfused THD RoPE and the
    #   reference attention each loop over a pack's sequences (a controlled sweep of packs of
    #   equal tokens and 4 to 64 sequences per rank, scripts/bench_sequence_cost.py: 1.94 ms per
    #   sequence and step of 2 attention layers on the 2-core AMD EPYC; docs/performance.md,
    #   "The missing term: a cost per sequence").
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo",
        peak_flops=96e9,
        gemm_efficiency=0.56,
        attention_efficiency=0.17,
        link_bandwidth=0.22e9,
        exposed_fraction=1.0,
        ring_step_latency=4e-3,
        layer_pass_overhead=2e-3,
        bytes_per_element=4,
        score_cache_bytes=16 * 2**20,
        score_spill_time=19e-9,
        sequence_pass_overhead=0.49e-3,
    ),
}

# H100 as above, with the fixed costs one NVIDIA H200 measured in eager PyTorch (bf16, flash
# attention, no Transformer Engine, one GPU; scripts/gpu_cost_probe.py, docs/performance.md "On a
# GPU"): a GPT layer's forward and backward never took less than 1.6 ms (four layer passes:
# 0.4 ms each, 40× the estimate above), and a ring chunk's attention forward and backward
# 0.3 ms whatever its size (0.15 ms per ring step of a layer pass, 10× the estimate). DCP never
# runs under CUDA graphs (it changes shapes and groups per micro-batch), so launches and Python
# dispatch are paid on every micro-batch; Transformer Engine's fused kernels launch fewer per
# layer, by an amount not measured yet. The work terms and links are h100-nvlink's; a ring step
# across nodes adds InfiniBand's extra 20 µs (35 against 15 µs above) to the measured step.
HARDWARE_PROFILES["h100-eager"] = replace(
    HARDWARE_PROFILES["h100-nvlink"],
    name="h100-eager",
    ring_step_latency=0.15e-3,
    layer_pass_overhead=0.4e-3,
    inter_node_ring_step_latency=0.17e-3,
)

# What training on a GPU plans with by default: the measured fixed costs.
DEFAULT_GPU_PROFILE = "h100-eager"
# What the simulator, the reference benchmark matrix and its pinned plans price with: the
# a-priori profile their published figures were made with.
REFERENCE_GPU_PROFILE = "h100-nvlink"
DEFAULT_CPU_PROFILE = "cpu-gloo"


def hardware_profile(name: str) -> HardwareProfile:
    """The profile called ``name``; SchedulingError naming the choices otherwise."""
    if name not in HARDWARE_PROFILES:
        raise SchedulingError(
            "{hardware}={name!r}: choose one of {names}.",
            name=name,
            names=", ".join(sorted(HARDWARE_PROFILES)),
        )
    return HARDWARE_PROFILES[name]
