"""Which megatron model settings DCP runs with: the start-up refusals.

``check_model_config`` runs once, before the first training step (``forward_backward.build_forward_backward``), on the
model's ``TransformerConfig``. Each refusal is a ValueError naming the flag and the fix, and has
a test (tests/integration/test_config.py). docs/usage.md ("Megatron features with DCP") lists
every feature with its status: tested, refused here, or GPU only.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from megatron_dcp.integration.config import DCP_FLAG
from megatron_dcp.integration.patches.table import NO_CUDA, TE_INSTALLED


def check_model_config(
    config: Any, te_available: Optional[bool] = None, cpu_backend: Optional[bool] = None
) -> None:
    """Reject model settings DCP cannot run with (``config`` is a megatron TransformerConfig).
    ``te_available`` / ``cpu_backend`` default to what this machine has (tests pass them)."""
    cpu_backend = _cpu_backend(cpu_backend)
    check_loss_and_exclusive_features(config)
    check_layer_kinds(config)
    check_sequence_parallel(config, te_available, cpu_backend)
    check_recompute(config, cpu_backend)
    check_cuda_graphs(config)
    check_tp_comm_overlap(config)
    check_moe(config)
    check_mla(config)
    if cpu_backend:
        check_cpu_precision(config)


def check_loss_and_exclusive_features(config: Any) -> None:
    if not config.calculate_per_token_loss:
        raise ValueError(
            f"{DCP_FLAG} needs --calculate-per-token-loss (calculate_per_token_loss=False): "
            "ranks run different CP groups and micro-batch sizes, so only sums of per-token "
            "losses divided by the global token count give the right gradient. Add "
            "--calculate-per-token-loss."
        )
    if getattr(config, "hybrid_context_parallel", False):
        raise ValueError(
            f"{DCP_FLAG} and --hybrid-context-parallel (megatron's own scheduler) exclude each "
            "other: remove --hybrid-context-parallel."
        )


# Layer kinds whose context parallelism megatron-core 0.19.2 runs over the static CP group (or
# not at all), with no per-micro-batch switch here: under DCP a micro-batch's own CP groups would
# never reach them. (Gated DeltaNet layers are switched by the patch table's
# ``gdn_context_parallel`` entry, in pretrain_gpt's models.)
UNSWITCHED_VARIANTS = {
    "dsa": "DeepSeek sparse attention's indexer has no per-micro-batch CP group",
}
UNSWITCHED_HYBRID_SYMBOLS = (
    (
        "G",
        "gated_delta_net",
        "Gated DeltaNet layers are switched per micro-batch in pretrain_gpt's models "
        "(--experimental-attention-variant gated_delta_net), not in the hybrid stack's",
    ),
    ("D", "dsa", UNSWITCHED_VARIANTS["dsa"]),
)


def check_layer_kinds(config: Any) -> None:
    """Refuse the layer kinds DCP cannot switch per micro-batch (``config``: a TransformerConfig
    or megatron's parsed arguments, which also carry ``--hybrid-layer-pattern``), on every
    backend: on a GPU megatron builds them and nothing would fail, the answer would be wrong."""
    variant = getattr(config, "experimental_attention_variant", None)
    if variant in UNSWITCHED_VARIANTS:
        raise ValueError(
            f"{DCP_FLAG} with --experimental-attention-variant {variant}: in megatron-core "
            f"0.19.2 {UNSWITCHED_VARIANTS[variant]}. Train this model with static context "
            f"parallelism (drop {DCP_FLAG}); DCP does not support it yet."
        )
    pattern = getattr(config, "hybrid_layer_pattern", None) or ""
    for symbol, kind, reason in UNSWITCHED_HYBRID_SYMBOLS:
        if symbol in pattern:
            raise ValueError(
                f"{DCP_FLAG} with --hybrid-layer-pattern {pattern!r}: its {symbol!r} layers are "
                f"{kind}, and in megatron-core 0.19.2 {reason}. Train it with static context "
                f"parallelism (drop {DCP_FLAG}) or leave out the {symbol!r} layers."
            )


def check_sequence_parallel(config: Any, te_available: Optional[bool], cpu_backend: bool) -> None:
    """Sequence parallelism runs with Transformer Engine, and on the CPU backend (whose torch-norm
    correction marks the norms for megatron's TP gradient sum, docs/cpu_backend.md). On a GPU
    without TE the local torch norm asserts (apex's would not), and that path has never been
    run: refused."""
    if not config.sequence_parallel or _te_available(te_available) or cpu_backend:
        return
    raise ValueError(
        f"{DCP_FLAG} with --sequence-parallel on a GPU needs Transformer Engine "
        "(--transformer-impl transformer_engine): megatron's local torch norm (no apex) "
        "rejects sequence parallelism, only the CPU backend corrects it, and the local path "
        "has not been run on a GPU. Install the 'te' extra or drop --sequence-parallel."
    )


def check_recompute(config: Any, cpu_backend: bool) -> None:
    """Selective recomputation of ``mlp`` with linear biases never finishes its backward pass
    in megatron-core 0.19.2 (the bias leaves the checkpoint as a non-leaf whose grad_fn
    re-enters it; also without DCP), and ``layernorm`` recomputation calls Transformer Engine's
    FP8 state unconditionally, which the CPU backend lacks."""
    if getattr(config, "recompute_granularity", None) != "selective":
        return
    modules = set(getattr(config, "recompute_modules", None) or ())
    if "mlp" in modules and getattr(config, "add_bias_linear", False):
        raise ValueError(
            f"{DCP_FLAG} with --recompute-modules mlp needs --disable-bias-linear: in "
            "megatron-core 0.19.2 the recomputed MLP hands its bias out of the checkpoint and "
            "the backward pass never finishes (with or without DCP). Add --disable-bias-linear "
            "or recompute core_attn instead."
        )
    for module in ("layernorm", "gdn_norm_out"):
        if module in modules and cpu_backend:
            raise ValueError(
                f"--recompute-modules {module} needs Transformer Engine (megatron-core 0.19.2 "
                "queries TE's FP8 state in its output-discarding checkpoint), which the CPU "
                f"backend has not: drop {module} from --recompute-modules on CPU."
            )


def check_cuda_graphs(config: Any) -> None:
    """CUDA graphs replay fixed shapes and communicators; DCP changes both per micro-batch."""
    graphs = getattr(config, "cuda_graph_impl", "none") not in (None, "none")
    if graphs or getattr(config, "enable_cuda_graph", False):
        raise ValueError(
            f"{DCP_FLAG} cannot run under CUDA graphs (--cuda-graph-impl "
            f"{getattr(config, 'cuda_graph_impl', None)!r} / --enable-cuda-graph): a graph "
            "replays one captured token count and CP group, and DCP micro-batches change both. "
            "Remove the CUDA graph flags."
        )


def check_tp_comm_overlap(config: Any) -> None:
    """Transformer Engine's userbuffers hold one fixed token count per rank; DCP micro-batches
    pack a different count each."""
    if getattr(config, "tp_comm_overlap", False):
        raise ValueError(
            f"{DCP_FLAG} cannot run with --tp-comm-overlap: Transformer Engine's userbuffers are "
            "allocated once for --seq-length x --micro-batch-size / --context-parallel-size "
            "tokens per rank and the overlapped GEMMs expect exactly that many, while every DCP "
            "micro-batch packs a different number. Remove --tp-comm-overlap (sequence "
            "parallelism without it is supported)."
        )


def check_cpu_precision(config: Any) -> None:
    """The CPU backend runs fp32: FP8/FP4 need Transformer Engine on a GPU."""
    low = getattr(config, "fp8", None) or getattr(config, "fp4", None)
    if low:
        flag = "--fp8-format" if getattr(config, "fp8", None) else "--fp4-format"
        raise ValueError(
            f"{flag} {low!r} needs Transformer Engine on a GPU; the CPU backend trains in fp32. "
            f"Drop {flag} on CPU."
        )


def check_moe(model_config: Any) -> None:
    """Refuse the MoE settings whose router statistics DCP cannot reduce over a micro-batch's
    tokens (the ``moe_router_group`` patch, docs/runtime.md "MoE layers"). TP > 1 runs: the
    wrapper creates the TP x CP groups of every CP group (``integration.process_groups``)."""
    if not getattr(model_config, "num_moe_experts", None):
        return
    modules = model_config.recompute_modules or []
    if model_config.recompute_granularity == "selective" and "moe" in modules:
        raise ValueError(
            f"{DCP_FLAG} with MoE does not support --recompute-modules moe: the "
            "router re-runs in the backward pass, outside the micro-batch's CP group. Use "
            "--recompute-granularity full or recompute other modules (moe_act is fine)."
        )


def check_mla(config: Any) -> None:
    """Multi-latent attention runs its RoPE on the micro-batch's CP group (the ``mla_rope``
    patch); selective recomputation of ``mla_up_proj`` re-runs that RoPE in the backward pass,
    outside the switch, on the static group."""
    if not getattr(config, "multi_latent_attention", False):
        return
    modules = getattr(config, "recompute_modules", None) or ()
    if getattr(config, "recompute_granularity", None) == "selective" and "mla_up_proj" in modules:
        raise ValueError(
            f"{DCP_FLAG} with multi-latent attention does not support --recompute-modules "
            "mla_up_proj: the recomputed up-projection applies RoPE in the backward pass, outside "
            "the micro-batch's CP group, over the static one. Recompute core_attn, or use "
            "--recompute-granularity full."
        )


def _cpu_backend(cpu_backend: Optional[bool]) -> bool:
    return NO_CUDA.holds() if cpu_backend is None else cpu_backend


def _te_available(te_available: Optional[bool]) -> bool:
    return TE_INSTALLED.holds() if te_available is None else te_available


def check_mamba_cp(nheads: int, ngroups: int, tp: int, cp_sizes: Sequence[int]) -> None:
    """Mamba layers under CP: each TP rank's heads are split over the CP group, and its B/C
    groups either split over it or repeated across it (megatron's ``MambaContextParallel``), for
    every CP size ``cp_sizes`` a plan may use."""
    heads, groups = nheads // tp, max(ngroups // tp, 1)
    for size in cp_sizes:
        if heads % size == 0 and (groups % size == 0 or size % groups == 0):
            continue
        raise ValueError(
            f"--hybrid-layer-pattern has Mamba layers, whose CP all-to-alls need the Mamba heads "
            f"per TP rank ({nheads} heads / TP {tp} = {heads}) divisible by every CP size a plan "
            f"may use ({', '.join(map(str, cp_sizes))}) and the groups per TP rank ({groups}) "
            f"to divide it or be divided by it; CP size {size} fails. Raise --mamba-num-heads "
            "(or lower --mamba-head-dim), shrink the DP×CP domain, or plan static CP with "
            "--sequence-packing-scheduler dp_balanced (only --context-parallel-size is used)."
        )


def check_gdn_args(args: Any, cp_sizes: Sequence[int]) -> None:
    """A Gated DeltaNet hybrid's flags (megatron's parsed ``args``), before megatron builds it:
    the SiLU its convolution asserts at the first forward, no MTP block (megatron.training
    cannot build one), :func:`check_gdn_cp`, and sequence parallelism with TP (the output
    norm's gradient)."""
    if not getattr(args, "swiglu", False):
        raise ValueError(
            "--experimental-attention-variant gated_delta_net needs --swiglu: megatron-core "
            "0.19.2's GatedDeltaNet applies the model's activation function after its short "
            "convolution and accepts only SiLU, which --swiglu selects (the MLPs become SwiGLU, "
            "as in Qwen3-Next). Add --swiglu."
        )
    if getattr(args, "mtp_num_layers", None):
        raise ValueError(
            f"--mtp-num-layers {args.mtp_num_layers} with --experimental-attention-variant "
            "gated_delta_net: megatron.training 0.19.2 builds the MTP layers from "
            "get_gpt_decoder_layer_specs, which asserts that no attention variant is set (on "
            "every backend). Drop --mtp-num-layers."
        )
    tp = args.tensor_model_parallel_size
    check_gdn_cp(args.linear_num_key_heads, args.linear_num_value_heads, tp, cp_sizes)
    if tp > 1 and not getattr(args, "sequence_parallel", False):
        raise ValueError(
            f"--experimental-attention-variant gated_delta_net with --tensor-model-parallel-size "
            f"{tp} needs --sequence-parallel: in megatron-core 0.19.2 every TP rank holds the "
            "whole GDN output-norm weight but computes its gradient from its own heads only, and "
            "finalize_model_grads sums such gradients over TP only for sequence-parallel "
            "parameters, so without it the replicas drift apart (with static CP too). Add "
            "--sequence-parallel."
        )


def check_gdn_cp(key_heads: int, value_heads: int, tp: int, cp_sizes: Sequence[int]) -> None:
    """Gated DeltaNet layers under CP: their all-to-all hands every rank of the CP group whole
    key and value heads of its TP rank (megatron's ``GatedDeltaNet``: every projection section,
    q/k, v, gate, beta and alpha, split over the group), for every CP size ``cp_sizes`` a plan
    may use."""
    per_tp = {"--linear-num-key-heads": key_heads, "--linear-num-value-heads": value_heads}
    for flag, heads in per_tp.items():
        local = heads // tp
        failing = [size for size in cp_sizes if local % size]
        if not failing:
            continue
        raise ValueError(
            f"--experimental-attention-variant gated_delta_net: {flag} {heads} / TP {tp} = "
            f"{local} heads per TP rank, which the GDN layers' CP all-to-all splits over every CP "
            f"size a plan may use ({', '.join(map(str, cp_sizes))}); CP size {failing[0]} "
            f"fails. Raise {flag} to a multiple of {tp * math.lcm(*cp_sizes)}, shrink the DP×CP "
            "domain, or plan static CP with --sequence-packing-scheduler dp_balanced (only "
            "--context-parallel-size is used)."
        )
