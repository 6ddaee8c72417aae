"""What the local model specs of the entry points cannot build, refused at start-up.

On the CPU backend (and with ``--transformer-impl local``) ``pretrain_gpt`` and ``pretrain_mamba``
build their models from megatron's local modules with the reference THD/CP attention
(``gpt_layer_spec``, ``hybrid_stack``). A model setting those specs cannot honour is refused
before megatron starts, by a ValueError naming the flag, its value and the fix (the entry points
turn it into one ``error: ...`` line): never a different module in its place, never a setting
dropped. docs/cpu_backend.md ("The model the CPU backend builds") lists what is built and what
is refused.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from megatron_dcp.integration.cpu.core_attention import check_reference_attention
from megatron_dcp.integration.cpu.gdn_layer_spec import GDN_VARIANT
from megatron_dcp.integration.megatron_import import import_megatron_core

import_megatron_core()

from megatron.core.transformer.enums import AttnBackend  # noqa: E402
from megatron.core.transformer.heterogeneous.heterogeneous_config import (  # noqa: E402
    HeterogeneousTransformerConfig,
)

# TransformerConfig fields that only Transformer Engine's layer specs read (megatron's local
# specs ignore them), with their flags.
TE_ONLY_OPTIONS = (
    ("use_transformer_engine_op_fuser", "--use-transformer-engine-op-fuser"),
    ("use_te_activation_func", "--use-te-activation-func"),
    ("use_grouped_gemm_for_dense_mlp", "--use-grouped-gemm-for-dense-mlp"),
    ("use_grouped_gemm_for_shared_expert", "--use-grouped-gemm-for-shared-expert"),
    ("mla_down_proj_fusion", "--mla-down-proj-fusion"),
)
# Hybrid layer symbols the local hybrid stack has no module for: (symbol, what it is).
HYBRID_UNBUILT = (
    ("G", "gated delta net"),
    ("D", "DeepSeek sparse attention"),
    ("+", "multi-latent attention"),
)


def where_and_fix(on_cpu: bool) -> Tuple[str, str]:
    """Where the local spec is used, and the way out that a refusal offers."""
    if on_cpu:
        return "on the CPU backend", "run on a GPU with Transformer Engine"
    return "with --transformer-impl local", "use --transformer-impl transformer_engine"


def check_local_gpt_spec(model_config: Any, on_cpu: bool) -> None:
    """ValueErrors for the settings of ``model_config`` (megatron's ``GPTModelConfig``) that the
    local GPT spec cannot build. ``on_cpu``: the CPU backend (else a GPU with
    ``--transformer-impl local``), which decides the fix the message offers."""
    config = model_config.transformer
    where, fix = where_and_fix(on_cpu)
    check_implementation(config.transformer_impl, on_cpu)
    if getattr(model_config, "restore_modelopt_state", False):
        raise ValueError(f"restoring a ModelOpt state (restore_modelopt_state) {where}: {fix}.")
    check_buildable(config, on_cpu)
    if isinstance(config, HeterogeneousTransformerConfig):
        check_heterogeneous(config)
    if not on_cpu and config.multi_latent_attention and config.tensor_model_parallel_size > 1:
        raise ValueError(
            f"--multi-latent-attention with --tensor-model-parallel-size "
            f"{config.tensor_model_parallel_size} {where}: megatron-core 0.19.2's local MLA "
            "spec drops the other TP ranks' share of the k_pos_emb gradient (only the CPU "
            f"backend corrects it, patch mla_local_kv_down_projection); {fix}."
        )
    if not on_cpu and config.mtp_num_layers:
        raise ValueError(
            f"--mtp-num-layers {config.mtp_num_layers} {where}: megatron builds the MTP layers "
            "with its local DotProductAttention, which rejects context parallelism and packed "
            f"sequences (only the CPU backend gives them the reference attention); {fix}."
        )


def check_local_hybrid_spec(model_config: Any, on_cpu: bool) -> None:
    """ValueErrors for the settings of ``model_config`` (megatron's ``HybridModelConfig``) that
    the local hybrid stack cannot build: its layer symbols first, then what the GPT spec
    refuses too."""
    config = model_config.transformer
    check_hybrid_pattern(model_config.hybrid_layer_pattern, config.mtp_num_layers, on_cpu)
    check_implementation(config.transformer_impl, on_cpu)
    check_buildable(config, on_cpu)


def check_hybrid_pattern(pattern: Optional[str], mtp_num_layers: Any, on_cpu: bool) -> None:
    """The layer symbols the local hybrid stack has modules for, and no MTP block."""
    where, fix = where_and_fix(on_cpu)
    pattern = pattern or ""
    for symbol, what in HYBRID_UNBUILT:
        if symbol in pattern:
            raise ValueError(
                f"--hybrid-layer-pattern {pattern}: '{symbol}' ({what}) layers {where} are not "
                f"built (megatron-core 0.19.2 has them from Transformer Engine modules only); "
                f"{fix}, or use M, *, - and E layers."
            )
    if "/" in pattern or mtp_num_layers:
        flag = f"--hybrid-layer-pattern {pattern}"
        if "/" not in pattern:
            flag = f"--mtp-num-layers {mtp_num_layers}"
        raise ValueError(
            f"{flag}: multi-token prediction in a hybrid model {where} is not built (the local "
            f"hybrid stack has no MTP block); {fix}, or drop the MTP layers."
        )


def check_cpu_args(args: Any) -> None:
    """On the CPU backend, megatron's parsed arguments (a namespace) before megatron validates
    them. Its validation queries the CUDA device for ``--moe-grouped-gemm``, asserts on
    ``--transformer-impl inference_optimized``, ``--attention-backend local`` and on flags an
    experimental attention variant or MLA needs (tracebacks, or its own words for what would be
    refused anyway): so the refusals that need only the flags come first."""
    where, fix = where_and_fix(on_cpu=True)
    check_implementation(args.transformer_impl, on_cpu=True)
    check_attention(args, where, fix)
    if getattr(args, "moe_grouped_gemm", False):
        raise ValueError(grouped_gemm_refusal(where, fix))
    if getattr(args, "hybrid_layer_pattern", None):
        mtp_layers = getattr(args, "mtp_num_layers", None)
        check_hybrid_pattern(args.hybrid_layer_pattern, mtp_layers, on_cpu=True)


def grouped_gemm_refusal(where: str, fix: str) -> str:
    return (
        f"--moe-grouped-gemm {where}: grouped experts are Transformer Engine's (TEGroupedMLP), "
        "and megatron's local spec would quietly build sequential experts instead. Drop "
        f"--moe-grouped-gemm to train sequential experts, or {fix}."
    )


def check_implementation(impl: str, on_cpu: bool) -> None:
    """The local modules are built: Transformer Engine's implementations are refused."""
    if impl != "local" and (on_cpu or impl == "inference_optimized"):
        where, _ = where_and_fix(on_cpu)
        default = " (the CPU default)" if on_cpu else ""
        raise ValueError(
            f"--transformer-impl {impl} {where}: the model is built from megatron's local "
            f"modules with the reference attention. Use --transformer-impl local{default}."
        )


def check_attention_backend(backend: Any, where: str) -> None:
    """The core attention is the reference one, whatever the backend: only ``auto`` says so."""
    if backend != AttnBackend.auto:
        name = getattr(backend, "name", backend)
        raise ValueError(
            f"--attention-backend {name} {where}: the core attention is the reference THD/CP "
            "attention (megatron's local DotProductAttention rejects context parallelism and "
            "packed sequences, Transformer Engine's kernels need a GPU). Drop "
            "--attention-backend (auto)."
        )


def check_buildable(config: Any, on_cpu: bool = True) -> None:
    """ValueErrors for the ``TransformerConfig`` settings the local specs cannot build."""
    where, fix = where_and_fix(on_cpu)
    check_attention(config, where, fix)
    if config.num_moe_experts is not None and config.moe_grouped_gemm:
        raise ValueError(grouped_gemm_refusal(where, fix))
    for field, flag in TE_ONLY_OPTIONS:
        if getattr(config, field, False):
            raise ValueError(
                f"{flag} {where}: a Transformer Engine option that megatron's local layer spec "
                f"ignores; drop {flag}, or {fix}."
            )
    check_reference_attention(config)


def check_attention(config: Any, where: str, fix: str) -> None:
    """Attention the reference core attention, inside megatron's local modules, cannot be
    (``config``: a ``TransformerConfig`` or megatron's parsed arguments)."""
    variant = config.experimental_attention_variant
    if variant not in (None, GDN_VARIANT):
        raise ValueError(
            f"--experimental-attention-variant {variant} {where}: megatron-core 0.19.2 builds "
            f"it from Transformer Engine modules only (only {GDN_VARIANT} has local modules "
            f"here); {fix}."
        )
    low_rank_query = getattr(config, "q_lora_rank", None) is not None
    if config.multi_latent_attention and config.qk_layernorm and not low_rank_query:
        raise ValueError(
            f"--qk-layernorm with --multi-latent-attention and no --q-lora-rank {where}: "
            "megatron-core 0.19.2 builds that query norm only fused into linear_q_proj "
            "(Transformer Engine's LayerNormColumnParallelLinear), and its local MLA spec "
            f"cannot; set --q-lora-rank (the query norm then normalises the compressed query), "
            f"drop --qk-layernorm, or {fix}."
        )
    kitchen_attention = getattr(config, "use_kitchen_attention", False)
    if getattr(config, "use_kitchen", False) or kitchen_attention:
        flag = "--use-kitchen-attention" if kitchen_attention else "kitchen"
        raise ValueError(f"{flag} {where}: kitchen's modules need a GPU; {fix}.")
    check_attention_backend(config.attention_backend, where)


def check_heterogeneous(config: Any) -> None:
    """megatron-core 0.19.2's heterogeneous spec reads neither experts, the L2 q/k norm nor an
    attention variant."""
    variant = config.experimental_attention_variant
    if variant is not None:
        raise ValueError(
            f"--experimental-attention-variant {variant} with --heterogeneous-layers-config-path: "
            "megatron-core 0.19.2 builds one or the other (on a GPU the variant wins and the "
            "heterogeneous layers are dropped); drop one of the two."
        )
    ignored = (("--num-experts", config.num_moe_experts), ("--qk-l2-norm", config.qk_l2_norm))
    for flag, value in ignored:
        if value:
            raise ValueError(
                f"{flag} {value} with --heterogeneous-layers-config-path: megatron-core 0.19.2 "
                "builds heterogeneous layers without it (they would be dense, without L2 q/k "
                "norms); drop one of the two."
            )
