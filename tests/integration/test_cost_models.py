"""The cost model of the trained model: read from megatron's TransformerConfig and from its parsed
arguments (the same shape either way), changed the right way by model size, TP, MoE, MTP, a
hybrid layer pattern, multi-latent attention and Gated DeltaNet layers; what ``pretrain_gpt``
and ``DCPConfig.for_model`` plan with by default, with
``--dcp-cost-profile`` and ``--dcp-hardware-profile``; the measured link bandwidths
(``--dcp-link-bandwidth``, ``--dcp-inter-node-link-bandwidth``) in the comm term and the node
layout's factors, and their refusals; the three flags; the ``[DCP]`` log line's
new fields as the launcher reads them; the quick-start's re-plan uses the run's cost model."""

from argparse import ArgumentParser, Namespace
from dataclasses import replace

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.scheduling.hardware import HARDWARE_PROFILES

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.config import DCPConfig, add_dcp_args  # noqa: E402
from megatron_dcp.integration.model_cost import (  # noqa: E402
    cost_model_of,
    model_shape_from_args,
    model_shape_of,
)
from megatron_dcp.scheduling import CostModel  # noqa: E402
from megatron_dcp.scheduling.cost_fit import CostProfile, coefficients, save_profile  # noqa: E402
from megatron_dcp.scheduling.model_shape import ModelShape  # noqa: E402

SMALL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024)
LARGE = dict(num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048)
FLAGS = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"}


def transformer_config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**SMALL, "use_cpu_initialization": True, **fields})


def cost(config, hardware="cpu-gloo", vocab=1000) -> CostModel:
    return cost_model_of(model_shape_of(config, vocab), hardware)


@pytest.fixture(scope="module")
def pretrain_gpt():
    from megatron_dcp import pretrain_gpt

    return pretrain_gpt


def megatron_args(pretrain_gpt, *flags: str) -> Namespace:
    """megatron's parser with the DCP flags (no validation: no process group needed)."""
    from megatron.training.arguments import add_megatron_arguments

    argv = ["--dynamic-context-parallel", "--micro-batch-size", "1", *flags]
    parser = pretrain_gpt.extra_args(argv)(
        add_megatron_arguments(ArgumentParser(allow_abbrev=False))
    )
    return parser.parse_args()


def size_flags(size: dict) -> list:
    return [x for name, value in size.items() for x in (f"--{name.replace('_', '-')}", str(value))]


def training_args(pretrain_gpt, size=SMALL, *flags: str) -> Namespace:
    """What ``check_args`` sees for a run of a model of ``size`` on dp2 × cp4 (budget 128)."""
    parsed = megatron_args(pretrain_gpt, *size_flags(size), "--vocab-size", "1000", *flags)
    return Namespace(
        **{
            **vars(parsed),
            "max_seqlen_per_dp_cp_rank": 128,
            "data_parallel_size": 2,
            "context_parallel_size": 4,
            "seq_length": 1024,
        }
    )


def test_two_model_sizes_give_different_coefficients_from_the_transformer_config():
    small, large = cost(transformer_config()), cost(transformer_config(**LARGE))
    assert coefficients(small) != coefficients(large)
    assert large.linear > 3 * small.linear and large.quadratic == pytest.approx(4 * small.quadratic)
    expected = ModelShape(
        **SMALL, num_query_groups=8, kv_channels=32, vocab_size=1000, gated_mlp=False
    )
    assert model_shape_of(transformer_config(), 1000) == expected


def test_args_and_transformer_config_give_the_same_shape(pretrain_gpt):
    flags = ["--swiglu", "--group-query-attention", "--num-query-groups", "2"]
    args = megatron_args(pretrain_gpt, *size_flags(SMALL), "--vocab-size", "1000", *flags)
    config = transformer_config(gated_linear_unit=True, num_query_groups=2)
    shape = model_shape_from_args(args)
    assert (shape.gated_mlp, shape.num_query_groups, shape.vocab_size) == (True, 2, 1000)
    assert cost_model_of(shape, "cpu-gloo") == cost(config)
    moe_flags = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "([1,0]*2)"]
    moe_flags += ["--moe-ffn-hidden-size", "512", "--mtp-num-layers", "1"]
    moe_args = megatron_args(pretrain_gpt, *size_flags(SMALL), "--vocab-size", "1000", *moe_flags)
    moe_config = transformer_config(
        num_moe_experts=8,
        moe_router_topk=2,
        moe_layer_freq=[1, 0, 1, 0],
        moe_ffn_hidden_size=512,
        mtp_num_layers=1,
    )
    assert model_shape_from_args(moe_args) == model_shape_of(moe_config, 1000)
    assert model_shape_from_args(moe_args).moe_layers == 2
    large = megatron_args(pretrain_gpt, *size_flags(LARGE), "--vocab-size", "1000", *flags)
    assert coefficients(cost_model_of(model_shape_from_args(large))) != coefficients(
        cost_model_of(shape)
    )


def test_tensor_parallelism_halves_the_per_rank_work():
    one, two = cost(transformer_config()), cost(transformer_config(tensor_model_parallel_size=2))
    assert two.linear == pytest.approx(one.linear / 2)
    assert two.quadratic == pytest.approx(one.quadratic / 2)
    assert two.comm == pytest.approx(one.comm / 2)
    assert (two.ring_step, two.microbatch) == (one.ring_step, one.microbatch)


def test_moe_layers_add_routed_expert_work_and_no_attention():
    dense = cost(transformer_config())
    moe_fields = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1024)
    every_other = transformer_config(**moe_fields, moe_layer_freq=2)
    listed = transformer_config(**moe_fields, moe_layer_freq=[1, 0, 1, 0])
    assert model_shape_of(every_other).moe_layers == 2 == model_shape_of(listed).moe_layers
    moe = cost(every_other)
    assert moe == cost(listed)
    # Two of the four MLPs become top-2 MoE layers: each costs 2 expert MLPs plus the router.
    mlp = 3.0 * 2 * 2 * 256 * 1024  # training FLOPs per token of one (non-gated) MLP
    router = 3.0 * 2 * 256 * 8
    cpu = HARDWARE_PROFILES["cpu-gloo"]
    flops_per_second = cpu.peak_flops * cpu.gemm_efficiency
    assert moe.linear - dense.linear == pytest.approx(2 * (mlp + router) / flops_per_second)
    assert moe.quadratic == dense.quadratic and moe.comm == dense.comm


def test_mtp_adds_a_layer_of_attention_and_an_output_head():
    base, mtp = cost(transformer_config()), cost(transformer_config(mtp_num_layers=1))
    assert mtp.quadratic == pytest.approx(base.quadratic * 5 / 4)  # 4 attention layers + 1
    assert mtp.linear > base.linear * 5 / 4  # a layer, the 2h→h projection and one more head
    assert mtp.ring_step > base.ring_step and mtp.microbatch > base.microbatch


def test_a_hybrid_pattern_sets_the_layer_counts():
    shape = model_shape_of(transformer_config(), 1000, hybrid_pattern="M*M-|ME/*-")
    assert (shape.num_layers, shape.mamba_layers, shape.num_attention_layers) == (6, 3, 1)
    assert (shape.num_mlp_layers, shape.moe_layers) == (1, 1)
    hybrid = cost_model_of(shape, "cpu-gloo")
    assert hybrid.quadratic == pytest.approx(cost(transformer_config()).quadratic / 4)
    with pytest.raises(ValueError, match="unknown layer symbols"):
        model_shape_of(transformer_config(), hybrid_pattern="M?M")


MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=24)


def mla_config(**fields):
    from megatron.core.transformer import MLATransformerConfig

    return MLATransformerConfig(**{**SMALL, "use_cpu_initialization": True, **MLA, **fields})


def test_multi_latent_attention_prices_its_own_projections_and_padded_values():
    shape = model_shape_of(mla_config(), 1000)
    heads, hidden, qk = 8, 256, 16 + 8
    assert (shape.head_dim, shape.query_dim, shape.kv_dim) == (qk, heads * qk, heads * qk)
    assert replace(shape, num_query_groups=2).kv_dim == heads * qk  # every head has its K and V
    # Up-projections and output sharded by heads; the down-projections whole on every TP rank.
    sharded = 2.0 * (48 * heads * qk + 32 * heads * (16 + 24) + heads * 24 * hidden)
    assert shape.attention_flops() == pytest.approx(sharded)
    assert shape.replicated_attention_flops() == pytest.approx(2.0 * hidden * (48 + 32 + 8))
    two = model_shape_of(mla_config(tensor_model_parallel_size=2), 1000)
    replicated = 3.0 * 4 * shape.replicated_attention_flops()
    assert two.linear_flops() - replicated == pytest.approx((shape.linear_flops() - replicated) / 2)
    # The L² core and the ring move K and the value padded to the query/key head size.
    standard = cost(transformer_config(kv_channels=qk))
    assert cost(mla_config()).quadratic == pytest.approx(standard.quadratic)
    assert cost(mla_config()).comm == pytest.approx(standard.comm)
    full_rank_query = model_shape_of(mla_config(q_lora_rank=None), 1000)
    assert full_rank_query.replicated_attention_flops() == pytest.approx(2.0 * hidden * (32 + 8))


def test_gated_delta_net_layers_are_linear_and_leave_the_ring_to_attention():
    gdn_fields = dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,
        linear_num_key_heads=4,
        linear_key_head_dim=16,
        linear_num_value_heads=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    shape = model_shape_of(transformer_config(**gdn_fields), 1000)
    assert (shape.gdn_layers, shape.num_attention_layers, shape.num_mlp_layers) == (3, 1, 4)
    hidden, qk, v = 256, 4 * 16, 8 * 16
    mixer = 2.0 * hidden * (2 * qk + 2 * v + 2 * 8) + 2.0 * (2 * qk + v) * 4
    mixer += 8.0 * 8 * 16 * 16 + 2.0 * v * hidden
    assert shape.gated_delta_net.flops(hidden) == pytest.approx(mixer)
    # Three of the four layers trade their attention projections for a mixer (training: ×3).
    dense_shape = model_shape_of(transformer_config(), 1000)
    swapped = 3 * 3.0 * (mixer - dense_shape.attention_flops())
    assert shape.linear_flops() - dense_shape.linear_flops() == pytest.approx(swapped)
    dense, gdn = cost(transformer_config()), cost(transformer_config(**gdn_fields))
    assert gdn.quadratic == pytest.approx(dense.quadratic / 4)  # one attention layer in four
    assert gdn.comm == pytest.approx(dense.comm / 4) and gdn.ring_step == dense.ring_step / 4
    listed = transformer_config(**{**gdn_fields, "linear_attention_freq": [1, 0, 1, 0]})
    listed = model_shape_of(listed)
    assert (listed.gdn_layers, listed.num_attention_layers) == (2, 2)
    hybrid = model_shape_of(transformer_config(), hybrid_pattern="G*G-")
    assert (hybrid.gdn_layers, hybrid.mamba_layers, hybrid.num_attention_layers) == (2, 0, 1)


def test_mla_and_gdn_flags_give_the_transformer_configs_shape(pretrain_gpt):
    from megatron.training.arguments import add_megatron_arguments

    def parsed(*flags: str) -> Namespace:
        parser = add_megatron_arguments(ArgumentParser(allow_abbrev=False))
        return parser.parse_args([*size_flags(SMALL), "--vocab-size", "1000", *flags])

    mla_flags = ["--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32"]
    mla_flags += ["--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "24"]
    assert model_shape_from_args(parsed(*mla_flags)) == model_shape_of(mla_config(), 1000)
    gdn_flags = ["--experimental-attention-variant", "gated_delta_net"]
    gdn_flags += ["--linear-attention-freq", "2", "--linear-num-key-heads", "4"]
    args = parsed(*gdn_flags)
    config = transformer_config(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=2,
        linear_num_key_heads=4,
    )
    assert model_shape_from_args(args) == model_shape_of(config, 1000)
    assert model_shape_from_args(args).gdn_layers == 2


def test_a_gpu_plans_with_the_fixed_costs_measured_in_eager_execution():
    from megatron_dcp.integration.model_cost import default_hardware_name

    assert default_hardware_name(on_cpu=False) == "h100-eager"
    assert default_hardware_name(on_cpu=True) == "cpu-gloo"
    config = transformer_config()
    prior, eager = cost(config, "h100-nvlink"), cost(config, "h100-eager")
    assert eager.microbatch == pytest.approx(40 * prior.microbatch)
    assert eager.ring_step == pytest.approx(10 * prior.ring_step)
    assert (eager.linear, eager.quadratic, eager.comm) == (prior.linear, prior.quadratic, prior.comm)
    bandwidth, latency = HARDWARE_PROFILES["h100-eager"].inter_node_factors()
    assert bandwidth == 9 and 1 < latency < 1.2  # a ring across nodes is never cheaper


def test_pretrain_gpt_plans_with_the_trained_models_coefficients(pretrain_gpt):
    small_args = training_args(pretrain_gpt)
    small = pretrain_gpt.check_args(small_args).cost_model
    large = pretrain_gpt.check_args(training_args(pretrain_gpt, LARGE)).cost_model
    assert small == cost_model_of(model_shape_from_args(small_args), "cpu-gloo")  # CPU backend
    assert small.name == "model@cpu-gloo" and coefficients(small) != coefficients(large)
    assert coefficients(small) != coefficients(CostModel.from_model_shape())  # not the 8B default
    gpu = pretrain_gpt.check_args(
        training_args(pretrain_gpt, SMALL, "--dcp-hardware-profile", "h100-nvlink")
    )
    assert gpu.cost_model.name == "model@h100-nvlink" and gpu.cost_adapt


def test_a_cost_profile_wins_over_the_model(pretrain_gpt, tmp_path):
    measured = CostModel(2e-6, 3e-9, 1e-7, 5e-5, 0.9, "calibrated", 4e-4)
    path = tmp_path / "profile.json"
    save_profile(str(path), CostProfile(measured, {"by": "test"}))
    args = training_args(pretrain_gpt, SMALL, "--dcp-cost-profile", str(path))
    assert pretrain_gpt.check_args(args).cost_model == measured


@pytest.mark.parametrize("content", [None, "{not json", '{"format": "other"}'])
def test_a_bad_cost_profile_names_the_flag(pretrain_gpt, tmp_path, content):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    args = training_args(pretrain_gpt, SMALL, "--dcp-cost-profile", str(path))
    with pytest.raises(ValueError, match=r"--dcp-cost-profile=.*profile\.json.*calibrate"):
        pretrain_gpt.check_args(args)


def test_the_cost_flags_parse_with_defaults_and_choices():
    parser = add_dcp_args(ArgumentParser())
    defaults = parser.parse_args([])
    assert (defaults.dcp_cost_profile, defaults.dcp_hardware_profile) == (None, None)
    assert (defaults.dcp_cost_adapt, defaults.dcp_time_steps) == ("on", "off")
    parsed = parser.parse_args(["--dcp-hardware-profile", "cpu-gloo", "--dcp-cost-adapt", "off"])
    assert (parsed.dcp_hardware_profile, parsed.dcp_cost_adapt) == ("cpu-gloo", "off")
    bad_values = (["--dcp-hardware-profile", "tpu"], ["--dcp-cost-adapt", "maybe"])
    for bad in (*bad_values, ["--dcp-time-steps", "yes"]):
        with pytest.raises(SystemExit):
            add_dcp_args(ArgumentParser()).parse_args(bad)


def test_cost_adapt_off_reaches_the_config(pretrain_gpt):
    args = training_args(pretrain_gpt, SMALL, "--dcp-cost-adapt", "off")
    assert pretrain_gpt.check_args(args).cost_adapt is False
    with pytest.raises(ValueError, match="--dcp-cost-adapt='off'"):
        DCPConfig(max_seqlen_per_dp_cp_rank=8, cost_adapt="off")


def test_time_steps_reaches_the_config(pretrain_gpt):
    args = training_args(pretrain_gpt, SMALL, "--dcp-cost-adapt", "off", "--dcp-time-steps", "on")
    config = pretrain_gpt.check_args(args)
    assert (config.cost_adapt, config.time_steps) == (False, True)
    assert pretrain_gpt.check_args(training_args(pretrain_gpt, SMALL)).time_steps is False
    with pytest.raises(ValueError, match="--dcp-time-steps='on'.*DCPConfig.time_steps: bool"):
        DCPConfig(max_seqlen_per_dp_cp_rank=8, time_steps="on")
    with pytest.raises(ValueError, match="DCPConfig.cost_model='model'"):
        DCPConfig(max_seqlen_per_dp_cp_rank=8, cost_model="model")


def test_for_model_derives_the_cost_model_and_with_model_fills_one_in():
    config = transformer_config(context_parallel_size=2)
    dcp = DCPConfig.for_model(config, 64, vocab_size=1000, hardware="h100-nvlink")
    assert dcp.cost_model == cost(config, "h100-nvlink")
    assert dcp.build_scheduler(4).cost_model == dcp.cost_model
    given = CostModel(1.0, 0.001, name="given")
    assert DCPConfig.for_model(config, 64, cost_model=given).cost_model is given
    bare = DCPConfig(max_seqlen_per_dp_cp_rank=64, cp_size=2)
    assert bare.with_model(config).cost_model == cost_model_of(model_shape_of(config))
    with pytest.raises(ValueError, match="--dcp-hardware-profile='tpu'"):
        DCPConfig.for_model(config, 64, hardware="tpu")


def test_the_log_line_carries_both_step_times_and_the_launcher_reads_them():
    from megatron_dcp.integration.forward_backward import BatchStats
    from megatron_dcp.integration.training.dcp_schedule import DCPSchedule
    from megatron_dcp.scheduling.cost_fit import OnlineRefinement
    from megatron_dcp.tools.launching.training_runs import parse_log

    stats = BatchStats(3, {1: 5, 2: 4}, 0.0037, 4000, 0, 0, 0, 1.008, predicted_step_s=0.8123)
    schedule = DCPSchedule(DCPConfig(max_seqlen_per_dp_cp_rank=8), print, iteration=lambda: 7)
    line = schedule.describe(stats, elapsed_s=2.0, times=[0.5, 0.95, 0.6, 0.75])
    figures = parse_log(line).dcp[7]
    assert (figures.predicted_step_ms, figures.measured_step_ms) == (812.3, 950.0)
    assert figures.measured_imbalance == pytest.approx(0.95 / 0.7, abs=1e-3)
    assert (figures.microbatches, figures.cp_sizes, figures.tokens_per_s) == (3, {1: 5, 2: 4}, 2000)
    assert "cost x prior" not in line
    schedule.refinement = OnlineRefinement(CostModel(1.0, 0.001))
    line = schedule.describe(stats, elapsed_s=2.0, times=[0.5, 0.95, 0.6, 0.75])
    assert line.endswith("| cost x prior: a 1 b 1 b_cp 1 comm 1 ring 1 mb 1")
    assert parse_log(line).dcp[7] == figures


def test_an_untimed_step_says_so_and_the_launcher_reads_no_measured_figures():
    """Adaptation off and no tool asking for times: the line prints no measured figure (not 0)."""
    from megatron_dcp.integration.forward_backward import BatchStats
    from megatron_dcp.integration.training.dcp_schedule import DCPSchedule
    from megatron_dcp.tools.launching.training_runs import parse_log

    stats = BatchStats(3, {1: 5, 2: 4}, 0.0037, 4000, 0, 0, 0, 1.008, predicted_step_s=0.8123)
    config = DCPConfig(max_seqlen_per_dp_cp_rank=8, cost_adapt=False)
    schedule = DCPSchedule(config, print, iteration=lambda: 7)
    assert not schedule.times_steps
    assert DCPSchedule(replace(config, time_steps=True), print).times_steps
    line = schedule.describe(stats)
    assert line.endswith(
        "| load imbalance est.: 1.008 | fwd-bwd time (ms) pred.: 812.3 | "
        "step not timed (--dcp-cost-adapt off)"
    )
    figures = parse_log(line).dcp[7]
    assert (figures.estimated_imbalance, figures.predicted_step_ms) == (1.008, 812.3)
    assert (figures.measured_imbalance, figures.measured_step_ms, figures.tokens_per_s) == (
        None,
        None,
        None,
    )
    assert (figures.microbatches, figures.cp_sizes) == (3, {1: 5, 2: 4})


@pytest.mark.parametrize("sft", [False, True], ids=["mock", "sft"])
def test_the_quickstart_replans_with_the_runs_cost_model(pretrain_gpt, sft, tmp_path):
    """The quick-start re-plans iteration 1 as the DCP run planned it: ``DCPConfig.from_args``
    of its flags over its DP×CP domain (8 ranks / TP 2); the 8B default plans these otherwise. With
    ``--sft`` the vocabulary (the output layer's cost) comes from the trained tokenizer, padded
    as megatron pads it."""
    import random

    from megatron_dcp.scheduling import build_scheduler
    from megatron_dcp.tools.launching.training_runs import flag_list
    from megatron_dcp.tools.quickstart import (
        MODEL,
        NPROC,
        TP,
        first_plans,
        run_cost_model,
        sft_model,
    )

    rng = random.Random(0)
    lengths = [max(16, min(1024, int(rng.lognormvariate(5.3, 1.2)))) for _ in range(16)]
    model = sft_model(tmp_path) if sft else MODEL
    args = megatron_args(pretrain_gpt, *flag_list(model))
    # megatron pads the tokenizer's vocabulary (128 or 512) to a multiple of 128 × TP when it
    # builds the tokenizer while validating the arguments, which megatron_args skips.
    args.padded_vocab_size = 512 if sft else 256
    run = DCPConfig.from_args(args)
    assert run_cost_model(model) == run.cost_model and run.cost_model.name == "model@cpu-gloo"
    plans = first_plans(model, lengths)
    assert plans["default_dynamic_cp"] == run.build_scheduler(NPROC // TP).schedule(lengths)
    default = build_scheduler(
        "default_dynamic_cp", dp_size=1, cp_size=4, max_seqlen_per_dp_cp_rank=256
    )
    assert plans["default_dynamic_cp"] != default.schedule(lengths)


def test_the_link_bandwidth_flag_sets_the_comm_coefficient(pretrain_gpt):
    gloo = ("--dcp-hardware-profile", "cpu-gloo")
    base = pretrain_gpt.check_args(training_args(pretrain_gpt, SMALL, *gloo)).cost_model
    rate = HARDWARE_PROFILES["cpu-gloo"].link_bandwidth / 10
    flags = (*gloo, "--dcp-link-bandwidth", str(rate))
    slow = pretrain_gpt.check_args(training_args(pretrain_gpt, SMALL, *flags)).cost_model
    assert slow.comm == pytest.approx(10 * base.comm)
    assert coefficients(slow)[:2] == coefficients(base)[:2]  # linear and quadratic untouched
    given = CostModel(1.0, 0.001, name="given")
    assert DCPConfig.for_model(
        transformer_config(), 64, hardware="cpu-gloo", link_bandwidth=rate
    ).cost_model == replace(cost(transformer_config(), vocab=None), comm=slow.comm)
    assert DCPConfig.for_model(transformer_config(), 64, cost_model=given).cost_model is given


def test_the_inter_node_flags_set_the_node_layout_factors():
    h100 = HARDWARE_PROFILES["h100-nvlink"]
    ranks = dict(cp_size=2, ranks_per_node=4, hardware="h100-nvlink")

    def comm_factor(**links) -> float:
        scheduler = DCPConfig(2048, **ranks, **links).build_scheduler(8, domain_ranks=range(8))
        return scheduler.cost_model.nodes.comm_factor

    assert comm_factor() == pytest.approx(9.0)
    assert comm_factor(inter_node_link_bandwidth=25e9) == pytest.approx(18.0)
    assert comm_factor(link_bandwidth=100e9) == pytest.approx(2.0)
    gloo = dict(cp_size=2, ranks_per_node=4, hardware="cpu-gloo", inter_node_link_bandwidth=1e7)
    nodes = DCPConfig(2048, **gloo).build_scheduler(8, domain_ranks=range(8)).cost_model.nodes
    assert nodes.comm_factor == pytest.approx(HARDWARE_PROFILES["cpu-gloo"].link_bandwidth / 1e7)
    assert h100.inter_node_factors()[0] == pytest.approx(9.0)  # the profile itself unchanged


@pytest.mark.parametrize("flag", ["link_bandwidth", "inter_node_link_bandwidth"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "fast", True])
def test_a_bad_link_bandwidth_names_the_flag(flag, value):
    name = "--dcp-" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=f"{name}={value!r}: must be a positive number"):
        DCPConfig(2048, **{flag: value})


def test_link_bandwidths_conflict_with_a_profile_and_an_inverted_tier(pretrain_gpt, tmp_path):
    path = tmp_path / "profile.json"
    save_profile(str(path), CostProfile(CostModel(2e-6, 3e-9, name="calibrated"), {}))
    for flag in ("--dcp-link-bandwidth", "--dcp-inter-node-link-bandwidth"):
        args = training_args(pretrain_gpt, SMALL, "--dcp-cost-profile", str(path), flag, "1e8")
        with pytest.raises(ValueError, match=f"--dcp-cost-profile=.* with {flag}=100000000.0"):
            pretrain_gpt.check_args(args)
    flags = ("--dcp-hardware-profile", "cpu-gloo", "--dcp-link-bandwidth", "-5")
    with pytest.raises(ValueError, match="--dcp-link-bandwidth=-5.0: must be a positive"):
        pretrain_gpt.check_args(training_args(pretrain_gpt, SMALL, *flags))
    inverted = DCPConfig(2048, ranks_per_node=4, hardware="h100-nvlink", link_bandwidth=1e9)
    with pytest.raises(ValueError, match="--dcp-inter-node-link-bandwidth=50000000000.0 is faster"):
        inverted.build_scheduler(8, domain_ranks=range(8))
