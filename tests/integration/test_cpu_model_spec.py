"""The model asked for is the model built, on the CPU backend: every model flag the
local specs of ``pretrain_gpt`` and ``pretrain_mamba`` cannot build is refused at start-up by
name, as one ``error: <flag> <value> ...`` line; every flag they build changes the built model
as claimed (the module it adds, and the parameter count ``testing.model_size`` computes from the
flags). In-process: megatron's argument parsing and the entry point's start-up, then megatron's
model builder on a one-rank job (a few seconds each)."""

import json

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing.entry_model import (  # noqa: E402
    TINY_FLAGS,
    built_model,
    prepare_entry,
    reset_megatron_arguments,
)
from megatron_dcp.testing.model_size import expected_parameters  # noqa: E402
from megatron_dcp.tools.launching.local_ranks import run_distributed  # noqa: E402

HYBRID = {"--hybrid-layer-pattern": "M*M-", "--num-layers": 4, "--mamba-head-dim": 16}
HYBRID.update({"--mamba-num-groups": 2, "--mamba-state-dim": 8})
EXPERTS = {"--num-experts": 4}
# A Gated DeltaNet hybrid: GDN layers 1-3, attention layer 4; 2 key and 4 value heads.
GDN = {"--experimental-attention-variant": "gated_delta_net", "--linear-attention-freq": 4}
GDN.update({"--num-layers": 4, "--swiglu": True, "--linear-key-head-dim": 8})
GDN.update({"--linear-value-head-dim": 16, "--linear-num-key-heads": 2})
GDN.update({"--linear-num-value-heads": 4})
# A two-layer heterogeneous model (megatron's HuggingFace "block_configs" format, which it
# requires to match these flags): layer 1 without attention and a smaller MLP, layer 2 with two
# query groups and its MLP replaced by one linear layer.
HETEROGENEOUS_FLAGS = {
    "--swiglu": True,
    "--normalization": "RMSNorm",
    "--group-query-attention": True,
    "--num-query-groups": 2,
    "--use-rope-scaling": True,
    "--rope-scaling-factor": 8.0,
    "--use-rotary-position-embeddings": True,
}
BLOCKS = {
    "hidden_act": "silu",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "tie_word_embeddings": True,
    "rope_theta": 10000,
    "rope_scaling": {"factor": 8.0},
    "block_configs": [
        {
            "attention": {"no_op": True, "replace_with_linear": False, "n_heads_in_group": None},
            "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 1.5},
        },
        {
            "attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 2},
            "ffn": {"no_op": False, "replace_with_linear": True, "ffn_mult": None},
        },
    ],
}


@pytest.fixture(autouse=True)
def fresh_megatron_arguments():
    """megatron parses its arguments once per process: forget them after each test."""
    yield
    reset_megatron_arguments()


@pytest.fixture
def heterogeneous(tmp_path):
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps(BLOCKS))
    return {**HETEROGENEOUS_FLAGS, "--heterogeneous-layers-config-path": str(path)}


def refusal(entry: str, flags: dict, capfd) -> str:
    """The one line the entry point's start-up prints for ``flags`` (after the tiny model's);
    it must exit with status 2 and print nothing else."""
    with pytest.raises(SystemExit) as exit_:
        prepare_entry(entry, {**TINY_FLAGS, **flags})
    printed = capfd.readouterr()
    assert exit_.value.code == 2 and printed.out == ""
    lines = printed.err.splitlines()
    assert len(lines) == 1, printed.err
    return lines[0]


REFUSED_GPT = [
    ({**EXPERTS, "--moe-grouped-gemm": True}, "--moe-grouped-gemm on the CPU backend"),
    (
        {"--multi-latent-attention": True, "--qk-layernorm": True},
        "--qk-layernorm with --multi-latent-attention and no --q-lora-rank on the CPU backend",
    ),
    # DCP's own refusal comes first: on a GPU these layers build, and DCP refuses them there too.
    ({"--experimental-attention-variant": "dsa"}, "--dynamic-context-parallel with --experimen"),
    ({**GDN, "--swiglu": False}, "--experimental-attention-variant gated_delta_net needs --swig"),
    ({**GDN, "--mtp-num-layers": 1}, "--mtp-num-layers 1 with --experimental-attention-variant"),
    ({"--transformer-impl": "transformer_engine"}, "--transformer-impl transformer_engine on"),
    ({"--transformer-impl": "inference_optimized"}, "--transformer-impl inference_optimized on"),
    ({"--attention-backend": "flash"}, "--attention-backend flash on the CPU backend"),
    ({"--attention-backend": "local"}, "--attention-backend local on the CPU backend"),
    (
        {"--use-te-activation-func": True, "--no-bias-gelu-fusion": True},
        "--use-te-activation-func on the CPU backend",
    ),
    ({"--use-transformer-engine-op-fuser": True}, "--use-transformer-engine-op-fuser on the CPU"),
    ({"--use-grouped-gemm-for-dense-mlp": True}, "--use-grouped-gemm-for-dense-mlp on the CPU"),
    (
        {
            **EXPERTS,
            "--moe-shared-expert-intermediate-size": 32,
            "--use-grouped-gemm-for-shared-expert": True,
        },
        "--use-grouped-gemm-for-shared-expert on the CPU backend",
    ),
    ({"--use-kitchen-attention": True}, "--use-kitchen-attention on the CPU backend"),
    ({"--softmax-type": "learnable"}, "--softmax-type learnable: ReferenceCoreAttention"),
    ({"--window-size": "(8,0)"}, "--window-size (8, 0): ReferenceCoreAttention"),
    ({"--attention-dropout": 0.1}, "--attention-dropout 0.1: ReferenceCoreAttention"),
]
REFUSED_HYBRID = [
    ({"--hybrid-layer-pattern": "M*G-"}, "--dynamic-context-parallel with --hybrid-layer-pat"),
    ({"--hybrid-layer-pattern": "MD--"}, "--dynamic-context-parallel with --hybrid-layer-pat"),
    ({"--hybrid-layer-pattern": "M+--"}, "--hybrid-layer-pattern M+--: '+' (multi-latent"),
    ({"--hybrid-layer-pattern": "M*M-/M-"}, "--hybrid-layer-pattern M*M-/M-: multi-token"),
    ({"--mtp-num-layers": 1}, "--mtp-num-layers 1: multi-token prediction in a hybrid model"),
    ({"--transformer-impl": "transformer_engine"}, "--transformer-impl transformer_engine on"),
    (
        {"--hybrid-layer-pattern": "M*E-", **EXPERTS, "--moe-grouped-gemm": True},
        "--moe-grouped-gemm on the CPU backend",
    ),
]


@pytest.mark.parametrize("flags,error", REFUSED_GPT, ids=[e for _, e in REFUSED_GPT])
def test_pretrain_gpt_refuses_what_the_cpu_spec_cannot_build(flags, error, capfd):
    assert refusal("pretrain_gpt", flags, capfd).startswith(f"error: {error}")


@pytest.mark.parametrize("flags,error", REFUSED_HYBRID, ids=[e for _, e in REFUSED_HYBRID])
def test_pretrain_mamba_refuses_what_the_cpu_stack_cannot_build(flags, error, capfd):
    line = refusal("pretrain_mamba", {**HYBRID, **flags}, capfd)
    assert line.startswith(f"error: {error}")


def test_heterogeneous_layers_with_an_attention_variant_are_refused(heterogeneous, capfd):
    line = refusal("pretrain_gpt", {**heterogeneous, **GDN, "--num-layers": 2}, capfd)
    assert line.startswith("error: --experimental-attention-variant gated_delta_net with --het")


def test_heterogeneous_layers_with_experts_are_refused(heterogeneous, capfd):
    line = refusal("pretrain_gpt", {**heterogeneous, **EXPERTS}, capfd)
    assert line.startswith("error: --num-experts 4 with --heterogeneous-layers-config-path")


def test_gpu_local_implementation_refuses_mtp_with_the_te_fix():
    """On a GPU with --transformer-impl local, the fix offered is Transformer Engine, and MTP is
    refused (megatron builds its layers with DotProductAttention; only the CPU patch swaps it),
    and so is MLA with TP > 1 (only the CPU backend corrects its down projection's gradient)."""
    from megatron_dcp.integration.cpu.spec_refusals import check_local_gpt_spec

    _, model_config = prepare_entry("pretrain_gpt", TINY_FLAGS)
    check_local_gpt_spec(model_config, on_cpu=False)  # the tiny model is fine
    model_config.transformer.mtp_num_layers = 1
    with pytest.raises(ValueError, match=r"^--mtp-num-layers 1 with --transformer-impl local.*"):
        check_local_gpt_spec(model_config, on_cpu=False)
    model_config.transformer.mtp_num_layers = None
    model_config.transformer.multi_latent_attention = True  # the TP correction is CPU only
    model_config.transformer.tensor_model_parallel_size = 2
    with pytest.raises(ValueError, match=r"^--multi-latent-attention with --tensor-model-paral"):
        check_local_gpt_spec(model_config, on_cpu=False)
    model_config.transformer.multi_latent_attention = False
    model_config.transformer.qk_l2_norm = True
    model_config.transformer.use_te_activation_func = True
    with pytest.raises(ValueError, match="use --transformer-impl transformer_engine"):
        check_local_gpt_spec(model_config, on_cpu=False)


def build(entry: str, flags: dict, counted: bool = True) -> tuple:
    """(parameter count, module class by name) of the one-rank model ``entry`` builds, after
    checking the count against the one the flags ask for (``counted``: testing.model_size
    models these flags)."""
    flags = {**TINY_FLAGS, **flags}
    ((_, count, classes),) = run_distributed(built_model, 1, entry, flags, timeout_s=300)
    if counted:
        assert count == expected_parameters(flags)[0, 0]
    return count, classes


ATTENTION = "decoder.layers.0.self_attention"


def test_the_tiny_gpt_is_dense_with_reference_attention():
    _, classes = build("pretrain_gpt", {})
    assert classes[f"{ATTENTION}.core_attention"] == "ReferenceCoreAttention"
    assert classes["decoder.layers.0.mlp"] == "MLP"
    assert f"{ATTENTION}.q_layernorm" not in classes


def test_num_experts_builds_sequential_experts_and_a_router():
    dense, _ = build("pretrain_gpt", {})
    count, classes = build("pretrain_gpt", EXPERTS)
    assert count > dense
    for layer in (0, 1):
        assert classes[f"decoder.layers.{layer}.mlp"] == "MoELayer"
        assert classes[f"decoder.layers.{layer}.mlp.router"] == "TopKRouter"
        assert classes[f"decoder.layers.{layer}.mlp.experts"] == "SequentialMLP"
        assert classes[f"decoder.layers.{layer}.mlp.experts.local_experts.3"] == "MLP"
    assert classes[f"{ATTENTION}.core_attention"] == "ReferenceCoreAttention"


def test_moe_layer_frequency_and_shared_experts_are_built():
    flags = {**EXPERTS, "--num-layers": 4, "--moe-layer-freq": 2}
    _, classes = build("pretrain_gpt", {**flags, "--moe-shared-expert-intermediate-size": 32})
    kinds = [classes[f"decoder.layers.{layer}.mlp"] for layer in range(4)]
    assert kinds == ["MoELayer", "MLP", "MoELayer", "MLP"]
    assert classes["decoder.layers.2.mlp.shared_experts"] == "SharedExpertMLP"


@pytest.mark.parametrize(
    "flags,norm",
    [
        ({"--qk-layernorm": True}, "LayerNorm"),
        ({"--qk-layernorm": True, "--normalization": "RMSNorm"}, "RMSNorm"),
        ({"--qk-l2-norm": True}, "L2Norm"),
    ],
)
def test_qk_norms_are_built(flags, norm):
    _, classes = build("pretrain_gpt", flags)
    for layer in (0, 1):
        for which in ("q_layernorm", "k_layernorm"):
            assert classes[f"decoder.layers.{layer}.self_attention.{which}"] == norm


def test_mtp_layers_follow_the_decoder_config():
    _, classes = build("pretrain_gpt", {**EXPERTS, "--mtp-num-layers": 1, "--qk-layernorm": True})
    layer = "mtp.layers.0.mtp_model_layer"
    assert classes[f"{layer}.mlp.experts"] == "SequentialMLP"
    assert classes[f"{layer}.self_attention.core_attention"] == "ReferenceCoreAttention"
    assert classes[f"{layer}.self_attention.q_layernorm"] == "LayerNorm"


@pytest.mark.parametrize("extra", [{}, {**EXPERTS, "--moe-layer-freq": "[0,1,1,0]"}])
def test_gated_delta_net_layers_are_built_where_the_frequency_puts_them(extra):
    """Layers 1-3 GatedDeltaNet with fla's submodules' local counterparts, layer 4 attention;
    the MLPs (dense or MoE) as --moe-layer-freq says; the count as testing.model_size's."""
    _, classes = build("pretrain_gpt", {**GDN, **extra})
    mixers = [classes[f"decoder.layers.{layer}.self_attention"] for layer in range(4)]
    assert mixers == ["GatedDeltaNet"] * 3 + ["SelfAttention"]
    gdn = "decoder.layers.0.self_attention"
    assert classes[f"{gdn}.in_proj"] == "ColumnParallelLinear"
    assert classes[f"{gdn}.out_proj"] == "RowParallelLinear"
    assert classes[f"{gdn}.out_norm"] == classes["decoder.layers.0.input_layernorm"]
    assert classes["decoder.layers.3.self_attention.core_attention"] == "ReferenceCoreAttention"
    if extra:
        kinds = [classes[f"decoder.layers.{layer}.mlp"] for layer in range(4)]
        assert kinds == ["MLP", "MoELayer", "MoELayer", "MLP"]


def test_heterogeneous_layers_are_built_per_layer(heterogeneous):
    _, classes = build("pretrain_gpt", heterogeneous, counted=False)  # per-layer shapes
    assert classes[ATTENTION] == "IdentityOp"  # layer 1: no attention
    assert classes["decoder.layers.1.self_attention.core_attention"] == "ReferenceCoreAttention"
    assert classes["decoder.layers.1.mlp"] == "ColumnParallelLinearGathered"


def test_hybrid_moe_layers_and_qk_norms_are_built():
    plain, classes = build("pretrain_mamba", HYBRID)
    assert "decoder.layers.1.self_attention.q_layernorm" not in classes
    flags = {**HYBRID, "--hybrid-layer-pattern": "M*E-", **EXPERTS, "--qk-layernorm": True}
    count, classes = build("pretrain_mamba", flags)
    assert classes["decoder.layers.2"] == "MoETransformerLayer"
    assert classes["decoder.layers.2.mlp.experts"] == "SequentialMLP"
    assert classes["decoder.layers.1.self_attention.q_layernorm"] == "LayerNorm"
    assert classes["decoder.layers.1.self_attention.core_attention"] == "ReferenceCoreAttention"
    assert count > plain


MLA = {"--multi-latent-attention": True, "--kv-lora-rank": 32, "--qk-head-dim": 16}
MLA.update({"--qk-pos-emb-head-dim": 8, "--v-head-dim": 12})
MLA_MODULES = ("linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")


@pytest.mark.parametrize(
    "flags,query",
    [
        ({}, {"linear_q_proj": "ColumnParallelLinear"}),
        (
            {"--q-lora-rank": 48, "--qk-layernorm": True, "--normalization": "RMSNorm"},
            {
                "linear_q_down_proj": "ColumnParallelLinear",
                "linear_q_up_proj": "ColumnParallelLinear",
                "q_layernorm": "RMSNorm",
                "kv_layernorm": "RMSNorm",
            },
        ),
    ],
    ids=["direct-query", "low-rank-query-and-norms"],
)
def test_multi_latent_attention_is_built_from_local_modules(flags, query):
    """MLA layers: megatron's MLASelfAttention with its projections (direct or low-rank query,
    q/kv norms with --qk-layernorm) and the reference core attention; the parameter count is
    the one testing.model_size computes for MLA's projections."""
    _, classes = build("pretrain_gpt", {**MLA, **flags})
    for layer in (0, 1):
        attention = f"decoder.layers.{layer}.self_attention"
        assert classes[attention] == "MLASelfAttention"
        assert classes[f"{attention}.core_attention"] == "ReferenceCoreAttention"
        for name, kind in {**dict.fromkeys(MLA_MODULES, "ColumnParallelLinear"), **query}.items():
            expected = "RowParallelLinear" if name == "linear_proj" else kind
            assert classes[f"{attention}.{name}"] == expected, name
    if "--qk-layernorm" not in flags:
        assert classes[f"{ATTENTION}.kv_layernorm"] == "IdentityOp"
