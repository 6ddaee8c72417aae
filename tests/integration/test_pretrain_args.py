"""The entry point's flag checks: each bad DCP setting fails before the first step with a
ValueError naming the flag; per-token loss is on by default; argv is read without touching
sys.argv."""

from argparse import ArgumentParser, Namespace

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

GOOD = dict(
    dynamic_context_parallel=True,
    min_dynamic_context_parallel_size=1,
    sequence_packing_scheduler=None,
    micro_batch_size=1,
    max_seqlen_per_dp_cp_rank=128,
    calculate_per_token_loss=True,
    data_parallel_size=2,
    context_parallel_size=4,
    seq_length=1024,
    tensor_model_parallel_size=1,
    sequence_parallel=False,
    # The trained model (its cost model is the scheduler's; tests/integration/test_cost_models.py).
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
)


def args(**overrides):
    return Namespace(**{**GOOD, **overrides})


@pytest.fixture(scope="module")
def pretrain_gpt():
    from megatron_dcp import pretrain_gpt

    return pretrain_gpt


def test_good_flags_pass(pretrain_gpt):
    config = pretrain_gpt.check_args(args())
    assert config.scheduler == "default_dynamic_cp" and config.max_seqlen_per_dp_cp_rank == 128
    assert (config.cp_size, config.tp_size) == (4, 1)


def test_the_parser_reads_argv_and_turns_per_token_loss_on(pretrain_gpt, monkeypatch):
    from megatron.training.arguments import add_megatron_arguments

    monkeypatch.setattr("sys.argv", ["untouched"])
    parser = pretrain_gpt.extra_args(["--dynamic-context-parallel", "--micro-batch-size", "1"])(
        add_megatron_arguments(ArgumentParser(allow_abbrev=False))
    )
    parsed = parser.parse_args()
    assert parsed.dynamic_context_parallel and parsed.calculate_per_token_loss
    assert parsed.micro_batch_size == 1
    import sys

    assert sys.argv == ["untouched"]


@pytest.mark.parametrize(
    "overrides,flag",
    [
        (dict(dynamic_context_parallel=False), "--dynamic-context-parallel"),
        (dict(min_dynamic_context_parallel_size=3), "--min-dynamic-context-parallel-size=3"),
        (dict(min_dynamic_context_parallel_size=16), "--min-dynamic-context-parallel-size=16"),
        (dict(max_seqlen_per_dp_cp_rank=None), "--max-seqlen-per-dp-cp-rank"),
        (dict(max_seqlen_per_dp_cp_rank=127), "--max-seqlen-per-dp-cp-rank=127"),
        (dict(micro_batch_size=2), "--micro-batch-size=2"),
        (dict(seq_length=2048), "--seq-length=2048"),
        (dict(sequence_packing_scheduler="dp_balanced", seq_length=1024), "--seq-length=1024"),
        (dict(calculate_per_token_loss=False), "--calculate-per-token-loss"),
        (dict(min_dynamic_context_parallel_size=16), "--min-dynamic-context-parallel-size=16"),
        (dict(sft_data="chats.jsonl", tokenizer_type="NullTokenizer"), "--tokenizer-type=Null"),
    ],
)
def test_bad_flags_are_rejected_before_training(pretrain_gpt, overrides, flag):
    with pytest.raises(ValueError, match=flag):
        pretrain_gpt.check_args(args(**overrides))


def test_dcp_flags_parse_with_upstream_names():
    from megatron_dcp.integration.config import add_dcp_args

    parser = add_dcp_args(ArgumentParser())
    parsed = parser.parse_args(
        [
            "--dynamic-context-parallel",
            "--min-dynamic-context-parallel-size",
            "2",
            "--sequence-packing-scheduler",
            "dp_balanced",
        ]
    )
    assert parsed.dynamic_context_parallel and parsed.min_dynamic_context_parallel_size == 2


# ------------------------------------------------------------------------------------------------
# pretrain_mamba: a layer pattern, and CP sizes the Mamba layers admit
# ------------------------------------------------------------------------------------------------

# hidden 64, head dim 16: 8 Mamba heads; 2 groups. The domain (dp 2 × cp 4) has groups of 1-8.
HYBRID = dict(
    hybrid_layer_pattern="M*M-", mamba_num_heads=None, mamba_head_dim=16, mamba_num_groups=2
)


@pytest.fixture(scope="module")
def pretrain_mamba():
    from megatron_dcp import pretrain_mamba

    return pretrain_mamba


def test_hybrid_flags_pass(pretrain_mamba):
    config = pretrain_mamba.check_hybrid_args(args(**HYBRID))
    assert pretrain_mamba.plan_cp_sizes(args(**HYBRID), config) == (1, 2, 4, 8)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hybrid_layer_pattern=None), "--hybrid-layer-pattern"),
        (dict(mamba_num_heads=4), r"4 heads / TP 1 = 4\) .*CP size 8 fails"),
        (dict(mamba_head_dim=32, tensor_model_parallel_size=2), r"TP 2 = 2\) .*CP size 4 fails"),
        (dict(mamba_num_groups=3, mamba_num_heads=24), r"groups per TP rank \(3\).*size 2 fails"),
    ],
)
def test_hybrid_flags_rejected_before_training(pretrain_mamba, overrides, message):
    with pytest.raises(ValueError, match=message):
        pretrain_mamba.check_hybrid_args(args(**{**HYBRID, **overrides}))


def test_static_cp_only_checks_the_static_size(pretrain_mamba):
    """dp_balanced gives every sequence --context-parallel-size ranks: 4 heads suffice at cp 4."""
    static = args(
        **{
            **HYBRID,
            "mamba_num_heads": 4,
            "sequence_packing_scheduler": "dp_balanced",
            "seq_length": 512,
        }
    )
    config = pretrain_mamba.check_hybrid_args(static)
    assert pretrain_mamba.plan_cp_sizes(static, config) == (4,)


def test_attention_only_pattern_has_no_mamba_constraint(pretrain_mamba):
    pretrain_mamba.check_hybrid_args(
        args(**{**HYBRID, "hybrid_layer_pattern": "*-*-", "mamba_num_heads": 1})
    )


# ------------------------------------------------------------------------------------------------
# pretrain_gpt with Gated DeltaNet layers: SiLU, and CP sizes the GDN heads admit
# ------------------------------------------------------------------------------------------------

# 8 key and 16 value heads; the domain (dp 2 × cp 4) has groups of 1-8.
GDN = dict(
    experimental_attention_variant="gated_delta_net",
    linear_attention_freq=2,
    swiglu=True,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


def test_gdn_flags_pass(pretrain_gpt):
    pretrain_gpt.check_gpt_args(args(**GDN))
    static = dict(sequence_packing_scheduler="dp_balanced", seq_length=512)
    pretrain_gpt.check_gpt_args(args(**{**GDN, **static, "linear_num_key_heads": 4}))
    tp2 = dict(tensor_model_parallel_size=2, linear_num_key_heads=16, linear_num_value_heads=32)
    pretrain_gpt.check_gpt_args(args(**{**GDN, **tp2, "sequence_parallel": True}))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(swiglu=False), "gated_delta_net needs --swiglu"),
        (dict(mtp_num_layers=1), "--mtp-num-layers 1 with --experimental-attention-variant"),
        (dict(linear_num_key_heads=4), r"--linear-num-key-heads 4 / TP 1 = 4 .*CP size 8 fails"),
        (
            dict(tensor_model_parallel_size=2),
            r"--linear-num-key-heads 8 / TP 2 = 4 .*size 8 fails\. Raise .* multiple of 16",
        ),
        (
            dict(tensor_model_parallel_size=2, linear_num_key_heads=16, linear_num_value_heads=32),
            r"--tensor-model-parallel-size 2 needs --sequence-parallel: .*output-norm weight",
        ),
    ],
)
def test_gdn_flags_rejected_before_training(pretrain_gpt, overrides, message):
    with pytest.raises(ValueError, match=message):
        pretrain_gpt.check_gpt_args(args(**{**GDN, **overrides}))
