"""The cost model of the trained model: its :class:`ModelShape` read from megatron's
TransformerConfig (:func:`model_shape_of`) or parsed arguments (:func:`model_shape_from_args`),
the hardware profile of the backend (:func:`default_hardware_name`), and the step time a plan
implies under a cost model (:func:`predicted_step_time`).

Every rank builds the same cost model from the same configuration (same floats), so every rank
plans the same way. ``--dcp-cost-profile`` (a measured profile) replaces it; online refinement
corrects it while training runs (``integration.training.dcp_schedule``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Union

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.cost_fit import coefficients, predict, rank_features
from megatron_dcp.scheduling.hardware import (
    DEFAULT_CPU_PROFILE,
    DEFAULT_GPU_PROFILE,
    HardwareProfile,
    hardware_profile,
)
from megatron_dcp.scheduling.model_shape import GatedDeltaNetDims, LatentAttention, ModelShape
from megatron_dcp.scheduling.plan import Plan

# megatron's hybrid layer pattern symbols (megatron.core.models.hybrid.hybrid_layer_allocation)
# by the layer kind of ModelShape they count as: Mamba and gated delta net mixers are linear in L,
# the three attention kinds have the L² core, '-' is a dense MLP and 'E' a MoE layer.
HYBRID_KINDS = {
    "M": "mamba_layers",
    "G": "gdn_layers",
    "*": "attention_layers",
    "D": "attention_layers",
    "+": "attention_layers",
    "-": "mlp_layers",
    "E": "moe_layers",
}
PIPE, MTP_SEPARATOR = "|", "/"


def model_shape_of(
    config: Any, vocab_size: Optional[int] = None, hybrid_pattern: Optional[str] = None
) -> ModelShape:
    """The shape of a model with megatron TransformerConfig ``config``. Without ``vocab_size``
    the output head is left out of the linear cost; ``hybrid_pattern`` (megatron's hybrid layer
    pattern, e.g. ``"M-M*-"``) sets the layer counts of a hybrid Mamba model."""
    heads = config.num_attention_heads
    experts = config.num_moe_experts or 0
    values: Dict[str, Any] = dict(
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size or 4 * config.hidden_size,
        num_layers=config.num_layers or 0,
        num_attention_heads=heads,
        num_query_groups=config.num_query_groups or heads,
        kv_channels=config.kv_channels or config.hidden_size // heads,
        vocab_size=vocab_size or 0,
        gated_mlp=bool(config.gated_linear_unit),
        moe_layers=moe_layer_count(config.moe_layer_freq, config.num_layers or 0) if experts else 0,
        num_experts=experts,
        moe_topk=config.moe_router_topk if experts else 0,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        shared_expert_size=config.moe_shared_expert_intermediate_size or 0,
        mamba_state_dim=config.mamba_state_dim,
        mamba_head_dim=config.mamba_head_dim,
        mamba_num_groups=config.mamba_num_groups,
        mtp_depth=config.mtp_num_layers or 0,
        tp_size=config.tensor_model_parallel_size,
        latent_attention=latent_attention_of(config),
        gated_delta_net=gated_delta_net_of(config),
    )
    pattern = hybrid_pattern or getattr(config, "hybrid_layer_pattern", None)
    if pattern:
        values.update(hybrid_layer_counts(pattern))
    elif getattr(config, "experimental_attention_variant", None) == GATED_DELTA_NET:
        gdn = sum(linear_attention_pattern(config.linear_attention_freq, values["num_layers"]))
        values.update(gdn_layers=gdn, attention_layers=values["num_layers"] - gdn)
    return ModelShape(**values)


GATED_DELTA_NET = "gated_delta_net"


def latent_attention_of(config: Any) -> Optional[LatentAttention]:
    """MLA's dimensions when ``config`` asks for multi-latent attention, else None."""
    if not getattr(config, "multi_latent_attention", False):
        return None
    return LatentAttention(
        kv_lora_rank=config.kv_lora_rank,
        qk_head_dim=config.qk_head_dim,
        qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=config.q_lora_rank,
    )


def gated_delta_net_of(config: Any) -> GatedDeltaNetDims:
    """The Gated DeltaNet mixer's dimensions (megatron's defaults where ``config`` has none)."""
    names = {
        "num_key_heads": "linear_num_key_heads",
        "key_head_dim": "linear_key_head_dim",
        "num_value_heads": "linear_num_value_heads",
        "value_head_dim": "linear_value_head_dim",
        "conv_kernel": "linear_conv_kernel_dim",
    }
    default = GatedDeltaNetDims()
    values = {field: getattr(config, name, None) for field, name in names.items()}
    return GatedDeltaNetDims(
        **{field: value or getattr(default, field) for field, value in values.items()}
    )


def linear_attention_pattern(freq: Union[int, Sequence[int], None], num_layers: int) -> List[int]:
    """megatron's ``--linear-attention-freq`` per layer (1: linear attention, here Gated
    DeltaNet; 0: standard attention): an int N makes every N-th layer standard attention."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--linear-attention-freq={freq}: must be >= 1")
        return [0 if (i + 1) % freq == 0 else 1 for i in range(num_layers)]
    if freq is None or len(freq) != num_layers:
        raise ValueError(
            f"--linear-attention-freq={freq!r}: Gated DeltaNet needs an int N (every N-th layer "
            f"is standard attention) or one 0/1 per layer ({num_layers} layers)."
        )
    return [1 if flag else 0 for flag in freq]


def moe_layer_count(moe_layer_freq: Union[int, Sequence[int]], num_layers: int) -> int:
    """MoE layers of megatron's ``moe_layer_freq``: an int k makes layers 0, k, 2k, ... MoE; a
    list marks each layer (1: MoE, 0: dense)."""
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ValueError(f"--moe-layer-freq={moe_layer_freq}: must be >= 1")
        return -(-num_layers // moe_layer_freq)
    return sum(1 for flag in moe_layer_freq if flag)


def hybrid_layer_counts(pattern: str) -> Dict[str, int]:
    """Layer counts of the main decoder in a hybrid layer pattern (pipeline separators skipped,
    the MTP part after ``/`` left to ``mtp_depth``)."""
    main = pattern.split(MTP_SEPARATOR)[0].replace(PIPE, "")
    unknown = sorted(set(main) - set(HYBRID_KINDS))
    if unknown:
        raise ValueError(
            f"--hybrid-layer-pattern={pattern!r}: unknown layer symbols {unknown}; the cost model "
            f"knows {''.join(sorted(HYBRID_KINDS))}."
        )
    counts = {kind: 0 for kind in HYBRID_KINDS.values()}
    for symbol in main:
        counts[HYBRID_KINDS[symbol]] += 1
    return {"num_layers": len(main), **counts}


def model_shape_from_args(args: Any) -> ModelShape:
    """The shape of the model megatron's parsed arguments ``args`` describe (vocabulary: the
    padded size when megatron has set it, else ``--vocab-size``), with the vision encoder of a
    vision-language model (``pretrain_vlm``'s ``--vision-*`` flags)."""
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
    pattern = getattr(args, "hybrid_layer_pattern", None) or getattr(
        args, "hybrid_override_pattern", None
    )
    shape = model_shape_of(config_view(args), vocab, pattern)
    return dataclasses.replace(shape, **vision_dims(args)) if vision_dims(args) else shape


CLASS_TOKENS = 1  # a CLIP ViT's class token: the encoder runs it with the patches


def vision_dims(args: Any) -> Dict[str, Any]:
    """The :class:`ModelShape` fields of the vision encoder ``pretrain_vlm``'s flags build (a
    CLIP ViT: ``--vision-num-layers``, ``--vision-hidden-size``, ``--vision-ffn-hidden-size``;
    its patches per tile from ``--img-h``, ``--img-w``, ``--patch-dim``, the class token
    included, as ``data.vlm_samples.encoder_patches`` counts them (not imported: it needs
    torch); its MLP gated as the language model's, whose config it copies); empty without
    ``--vision-num-layers``."""
    layers = getattr(args, "vision_num_layers", None)
    if not layers:
        return {}
    gated = getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False)
    return dict(
        vision_layers=layers,
        vision_hidden=args.vision_hidden_size,
        vision_ffn_hidden=getattr(args, "vision_ffn_hidden_size", None),
        vision_patches_per_tile=(args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
        + CLASS_TOKENS,
        vision_gated_mlp=bool(gated),
    )


def config_view(args: Any) -> SimpleNamespace:
    """The TransformerConfig fields :func:`model_shape_of` reads, from parsed arguments (the
    renames of megatron's ``core_transformer_config_from_args``: ``--num-experts``, ``--swiglu``,
    ``--group-query-attention``)."""
    gqa = getattr(args, "group_query_attention", False)
    gated = getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False)
    return SimpleNamespace(
        hidden_size=args.hidden_size,
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        num_layers=getattr(args, "num_layers", None),
        num_attention_heads=args.num_attention_heads,
        num_query_groups=getattr(args, "num_query_groups", None) if gqa else None,
        kv_channels=getattr(args, "kv_channels", None),
        gated_linear_unit=bool(gated),
        num_moe_experts=getattr(args, "num_experts", None),
        moe_router_topk=getattr(args, "moe_router_topk", 2),
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
        moe_shared_expert_intermediate_size=getattr(
            args, "moe_shared_expert_intermediate_size", None
        ),
        moe_layer_freq=getattr(args, "moe_layer_freq", 1),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        mamba_state_dim=getattr(args, "mamba_state_dim", 128),
        mamba_head_dim=getattr(args, "mamba_head_dim", 64),
        mamba_num_groups=getattr(args, "mamba_num_groups", 8),
        **{name: getattr(args, name, None) for name in PASSED_THROUGH},
    )


# Parsed arguments model_shape_of reads under the TransformerConfig field's own name.
PASSED_THROUGH = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "experimental_attention_variant",
    "linear_attention_freq",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def default_hardware_name(on_cpu: Optional[bool] = None) -> str:
    """``cpu-gloo`` when the CPU backend is on (``on_cpu`` None: ask the patch table), else
    ``h100-eager`` (an H100 with the fixed costs measured in eager execution)."""
    if on_cpu is None:
        from megatron_dcp.integration.patches.cpu_backend import cpu_backend_enabled

        on_cpu = cpu_backend_enabled()
    return DEFAULT_CPU_PROFILE if on_cpu else DEFAULT_GPU_PROFILE


def hardware_of(hardware: Union[str, HardwareProfile, None] = None) -> HardwareProfile:
    """The profile ``hardware``, or the one it names (default: :func:`default_hardware_name`);
    SchedulingError on an unknown name."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    return hardware_profile(hardware or default_hardware_name())


def cost_model_of(
    shape: ModelShape, hardware: Union[str, HardwareProfile, None] = None
) -> CostModel:
    """Seconds per rank of training ``shape`` on the hardware profile ``hardware`` (a profile or
    its name; default: :func:`default_hardware_name`); SchedulingError on an unknown name."""
    return CostModel.from_model_shape(shape, hardware_of(hardware))


def predicted_times(plan: Plan, cost: CostModel) -> List[float]:
    """Per position of the domain, the seconds ``cost`` predicts for what it runs in ``plan``."""
    theta = coefficients(cost)
    rows = rank_features(plan, cost.nodes, cost.spill_elements)
    return [predict(theta, row) for row in rows]


def predicted_step_time(plan: Plan, cost: CostModel) -> float:
    """The forward-backward seconds of the step: the busiest position's predicted time."""
    return max(predicted_times(plan, cost), default=0.0)


def describe_cost(cost: CostModel) -> str:
    """One line naming the cost model and its coefficients (seconds)."""
    return (
        f"DCP cost model {cost.name}: linear {cost.linear:.3g} s/token, quadratic "
        f"{cost.quadratic:.3g} s/token², comm {cost.comm:.3g} s/token, ring step "
        f"{cost.ring_step:.3g} s, cp efficiency {cost.cp_efficiency:.3g}, micro-batch "
        f"{cost.microbatch:.3g} s"
    )
