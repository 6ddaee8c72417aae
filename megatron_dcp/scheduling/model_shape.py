"""The shape of the trained model and its training FLOPs per token (linear in L) and per token
pair (quadratic in L), per tensor-parallel rank.

A model is a stack of layers of five kinds, counted separately so that GPT, MoE, hybrid Mamba
and Gated DeltaNet models share one description: attention layers (QKV and output projections,
plus the causal L² core), dense MLP layers, MoE layers (router, top-k routed experts, shared
expert), Mamba layers and Gated DeltaNet layers (both linear in L, with a per-sequence state and
no L² term). A GPT layer is one attention layer and one MLP (or MoE) layer. ``mtp_depth``
multi-token-prediction modules each add one GPT layer, a 2h→h projection and one more output
head.

Attention is standard (grouped-query) attention, or multi-latent attention (MLA, DeepSeek-V2/V3:
``latent_attention``): low-rank query and key/value projections, query/key heads of
``qk_head_dim + qk_pos_emb_head_dim`` and value heads of ``v_head_dim``. Packed (THD) MLA pads
each value head to the query/key head size before core attention (megatron-core's workaround for
kernels that need equal head sizes), so its L² core and its ring exchange move K and the padded V
at the query/key head size, for every head (MLA has no key/value groups).

A vision-language model (megatron-core's LLaVA) adds a ViT encoder (``vision_layers`` layers of
width ``vision_hidden``, MLP ``vision_ffn_hidden``, ``vision_patches_per_tile`` patches per tile,
class tokens included): its work is per encoder patch, not per token of the language model
(``vision_flops_per_patch``), and each tile's patches attend to each other only (bidirectional,
no causal mask), so the attention core costs per patch in proportion to the tile's patches.

The counts follow the usual 2 FLOPs per multiply-accumulate, and training costs three forward
passes (forward, and a backward of twice the forward). Everything is divided by the TP size:
GEMMs are sharded by columns and rows, attention by heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Forward + backward ≈ 3× the forward FLOPs.
TRAIN_FACTOR = 3.0
# Mamba-2 SSD work per token and per (inner channel × state) pair: the chunked scan's
# intra-chunk, state and output products, about 3 multiply-accumulates each.
MAMBA_SCAN_FLOPS = 6.0
# Gated delta rule work per token and per element of one value head's dk × dv state: decay, the
# state's read-out for the delta, the rank-1 write and the query read-out (4 multiply-adds).
DELTA_RULE_FLOPS = 8.0


@dataclass(frozen=True)
class LatentAttention:
    """Multi-latent attention's dimensions (megatron's ``--q-lora-rank`` ... ``--v-head-dim``;
    defaults: DeepSeek-V3's). ``q_lora_rank`` None: the query is one full-rank projection."""

    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: Optional[int] = 1536

    @property
    def head_dim(self) -> int:
        """Query/key head size (the value heads are padded to it in packed attention)."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def sharded_flops(self, hidden: int, heads: int) -> float:
        """Forward FLOPs per token of the projections TP shards by heads: the query (or its
        up-projection), the key/value up-projection and the output projection."""
        query_in = self.q_lora_rank or hidden
        up = query_in * heads * self.head_dim
        up += self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
        return 2.0 * (up + heads * self.v_head_dim * hidden)

    def replicated_flops(self, hidden: int) -> float:
        """Forward FLOPs per token of the down-projections every TP rank computes whole
        (Transformer Engine's ``duplicated`` linears)."""
        query_down = self.q_lora_rank or 0
        return 2.0 * hidden * (query_down + self.kv_lora_rank + self.qk_pos_emb_head_dim)


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """A Gated DeltaNet mixer's dimensions (megatron's ``--linear-*`` flags; defaults: theirs,
    Qwen3-Next's)."""

    num_key_heads: int = 16
    key_head_dim: int = 128
    num_value_heads: int = 32
    value_head_dim: int = 128
    conv_kernel: int = 4

    def flops(self, hidden: int) -> float:
        """Forward FLOPs per token of one mixer: the in-projection (q, k, v, gate z, beta,
        alpha), the short convolution over q/k/v, the delta rule and the out-projection."""
        qk = self.num_key_heads * self.key_head_dim
        v = self.num_value_heads * self.value_head_dim
        in_proj = 2.0 * hidden * (2 * qk + 2 * v + 2 * self.num_value_heads)
        conv = 2.0 * (2 * qk + v) * self.conv_kernel
        state = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return in_proj + conv + DELTA_RULE_FLOPS * state + 2.0 * v * hidden


@dataclass(frozen=True)
class ModelShape:
    """Dimensions that set the cost of a training token. Defaults: a Llama-3-8B-like GPT."""

    hidden_size: int = 4096
    ffn_hidden_size: int = 14336
    num_layers: int = 32
    num_attention_heads: int = 32
    num_query_groups: int = 8
    kv_channels: Optional[int] = None
    vocab_size: int = 128256
    gated_mlp: bool = True
    # Layer counts when they differ from ``num_layers`` (MoE and hybrid models); None: all.
    attention_layers: Optional[int] = None
    mlp_layers: Optional[int] = None
    moe_layers: int = 0
    mamba_layers: int = 0
    gdn_layers: int = 0
    # MoE: experts, top-k routed per token, expert and shared-expert FFN sizes.
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: Optional[int] = None
    shared_expert_size: int = 0
    # Mamba-2 mixer: state size, head size, groups (expansion 2: inner size 2h).
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    gated_delta_net: GatedDeltaNetDims = GatedDeltaNetDims()
    # Multi-latent attention's dimensions; None: standard attention.
    latent_attention: Optional[LatentAttention] = None
    mtp_depth: int = 0
    tp_size: int = 1
    # Vision encoder (a ViT, as megatron-core's LLaVA): layers (0: no encoder), width, MLP size
    # (None: 4 × width), patches per tile (class tokens included), gated (SwiGLU) MLP or not.
    vision_layers: int = 0
    vision_hidden: int = 1024
    vision_ffn_hidden: Optional[int] = None
    vision_patches_per_tile: int = 577
    vision_gated_mlp: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.hidden_size < 1 or self.num_layers < 0:
            raise ValueError(f"ModelShape needs positive sizes, got {self}")
        vision = (self.vision_layers, self.vision_hidden - 1, self.vision_patches_per_tile - 1)
        if min(vision) < 0 or (self.vision_ffn_hidden or 0) < 0:
            raise ValueError(f"ModelShape needs non-negative vision encoder sizes, got {self}")

    @property
    def head_dim(self) -> int:
        if self.latent_attention is not None:
            return self.latent_attention.head_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Key (or value) channels per token in core attention: MLA's are per head."""
        if self.latent_attention is not None:
            return self.query_dim
        return self.num_query_groups * self.head_dim

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers if self.attention_layers is None else self.attention_layers

    @property
    def num_mlp_layers(self) -> int:
        if self.mlp_layers is not None:
            return self.mlp_layers
        return self.num_layers - self.moe_layers

    def attention_flops(self) -> float:
        """Forward FLOPs per token of one attention layer's projections that TP shards (Q, K,
        V, output; MLA's up- and output projections)."""
        h = self.hidden_size
        if self.latent_attention is not None:
            return self.latent_attention.sharded_flops(h, self.num_attention_heads)
        return 2.0 * h * (2 * self.query_dim + 2 * self.kv_dim)

    def replicated_attention_flops(self) -> float:
        """Forward FLOPs per token of one attention layer that every TP rank computes whole
        (MLA's down-projections; 0 for standard attention)."""
        if self.latent_attention is None:
            return 0.0
        return self.latent_attention.replicated_flops(self.hidden_size)

    def mlp_flops(self, ffn: int) -> float:
        """Forward FLOPs per token of an MLP with FFN size ``ffn`` (three GEMMs when gated)."""
        return 2.0 * (3 if self.gated_mlp else 2) * self.hidden_size * ffn

    def moe_flops(self) -> float:
        """Forward FLOPs per token of one MoE layer: router, top-k experts, shared expert."""
        expert = self.mlp_flops(self.moe_ffn_hidden_size or self.ffn_hidden_size)
        shared = self.mlp_flops(self.shared_expert_size) if self.shared_expert_size else 0.0
        return 2.0 * self.hidden_size * self.num_experts + self.moe_topk * expert + shared

    def mamba_flops(self) -> float:
        """Forward FLOPs per token of one Mamba-2 mixer: in/out projections and the scan."""
        h, inner = self.hidden_size, 2 * self.hidden_size
        heads = inner // self.mamba_head_dim
        in_proj = 2.0 * h * (2 * inner + 2 * self.mamba_num_groups * self.mamba_state_dim + heads)
        return in_proj + 2.0 * inner * h + MAMBA_SCAN_FLOPS * inner * self.mamba_state_dim

    def head_flops(self) -> float:
        """Forward FLOPs per token of one output head (logits over the vocabulary)."""
        return 2.0 * self.hidden_size * self.vocab_size

    def linear_flops(self) -> float:
        """Training FLOPs per token that grow linearly with L, per TP rank."""
        body = (
            self.num_attention_layers * self.attention_flops()
            + self.num_mlp_layers * self.mlp_flops(self.ffn_hidden_size)
            + self.moe_layers * self.moe_flops()
            + self.mamba_layers * self.mamba_flops()
            + self.gdn_layers * self.gated_delta_net.flops(self.hidden_size)
            + self.head_flops()
        )
        mtp_layer = self.attention_flops() + self.mlp_flops(self.ffn_hidden_size)
        mtp = self.mtp_depth * (mtp_layer + 2.0 * 2 * self.hidden_size**2 + self.head_flops())
        replicated = self.attention_passes() * self.replicated_attention_flops()
        return TRAIN_FACTOR * ((body + mtp) / self.tp_size + replicated)

    def quadratic_flops(self) -> float:
        """Training FLOPs per (query, key) pair of L², per TP rank: QKᵀ and AV cost 4·d_q per
        pair, and causal masking keeps half of the pairs."""
        layers = self.num_attention_layers + self.mtp_depth
        return TRAIN_FACTOR * layers * 2.0 * self.query_dim / self.tp_size

    def kv_bytes(self, bytes_per_element: int) -> float:
        """Bytes of K and V one token sends around the CP ring in training, per TP rank:
        forward K/V, backward K/V again and their gradients (3 passes)."""
        layers = self.num_attention_layers + self.mtp_depth
        return TRAIN_FACTOR * layers * 2 * self.kv_dim * bytes_per_element / self.tp_size

    def heads_per_rank(self) -> int:
        """Attention heads one TP rank computes (each materialises its own score block)."""
        return max(1, self.num_attention_heads // self.tp_size)

    def attention_passes(self) -> int:
        """Attention layers one micro-batch runs, MTP's included."""
        return self.num_attention_layers + self.mtp_depth

    def ring_passes(self) -> int:
        """Ring passes per micro-batch: one forward and one backward per attention layer."""
        return 2 * (self.num_attention_layers + self.mtp_depth)

    def layer_passes(self) -> int:
        """Layer passes per micro-batch (forward and backward of every layer)."""
        layers = self.num_attention_layers + self.num_mlp_layers + self.moe_layers
        return 2 * (layers + self.mamba_layers + self.gdn_layers + 2 * self.mtp_depth)

    def vision_linear_flops(self) -> float:
        """Training FLOPs per encoder patch of the ViT's GEMMs, per TP rank: per layer the Q, K,
        V and output projections (full multi-head attention, 2·h·4h) and the MLP (two GEMMs,
        three when gated). 0 without an encoder."""
        if not self.vision_layers:
            return 0.0
        h = self.vision_hidden
        ffn = self.vision_ffn_hidden or 4 * h
        layer = 2.0 * h * 4 * h + 2.0 * (3 if self.vision_gated_mlp else 2) * h * ffn
        return TRAIN_FACTOR * self.vision_layers * layer / self.tp_size

    def vision_attention_flops(self) -> float:
        """Training FLOPs per encoder patch of the ViT's attention core, per TP rank: QKᵀ and AV
        over the tile's own patches, 4·h per (patch, patch) pair, every pair (no causal mask).
        0 without an encoder."""
        if not self.vision_layers:
            return 0.0
        pairs = self.vision_patches_per_tile
        return TRAIN_FACTOR * self.vision_layers * 4.0 * self.vision_hidden * pairs / self.tp_size

    def vision_flops_per_patch(self) -> float:
        """Training (forward + backward) FLOPs of the vision encoder per patch, per TP rank:
        :meth:`vision_linear_flops` + :meth:`vision_attention_flops` (0 without an encoder)."""
        return self.vision_linear_flops() + self.vision_attention_flops()
