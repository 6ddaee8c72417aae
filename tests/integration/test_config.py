"""The one DCP configuration: start-up validation (each unsupported setting is a ValueError
naming the flag and the fix), scheduler choices from the registry, and scheduling errors worded
for each layer (scheduling parameters, training flags, simulator flags)."""

from argparse import ArgumentParser
from types import SimpleNamespace

import pytest

from megatron_dcp.integration.config import (
    DEFAULT_ROUTING,
    DCPConfig,
    add_dcp_args,
    check_budget,
    flag_error,
)
from megatron_dcp.integration.model_checks import check_model_config
from megatron_dcp.scheduling import SCHEDULERS, build_scheduler
from megatron_dcp.scheduling.dp_balanced import DPBalancedScheduler
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.tools.error_wording import error_message

GOOD = dict(
    calculate_per_token_loss=True,
    hybrid_context_parallel=False,
    multi_latent_attention=False,
    sequence_parallel=False,
    recompute_granularity=None,
    recompute_modules=None,
    add_bias_linear=True,
    cuda_graph_impl="none",
    enable_cuda_graph=False,
    fp8=None,
    fp4=None,
)


def config(**overrides):
    return SimpleNamespace(**{**GOOD, **overrides})


def test_a_supported_config_passes():
    check_model_config(config(), te_available=False)
    check_model_config(config(sequence_parallel=True), te_available=True)
    # The CPU backend corrects megatron's torch norm for sequence parallelism (cpu_backend.md).
    check_model_config(config(sequence_parallel=True), te_available=False, cpu_backend=True)
    selective = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    check_model_config(config(**selective, add_bias_linear=False), cpu_backend=True)
    layernorm = dict(recompute_granularity="selective", recompute_modules=["layernorm"])
    check_model_config(config(**layernorm), te_available=True, cpu_backend=False)
    check_model_config(config(fp8="hybrid"), te_available=True, cpu_backend=False)
    # Multi-latent attention runs on the micro-batch's CP group (the mla_rope patch).
    mla = dict(multi_latent_attention=True, recompute_granularity="selective")
    check_model_config(config(**mla, recompute_modules=["core_attn"]), cpu_backend=True)
    # Gated DeltaNet layers switch per micro-batch (patch gdn_context_parallel), gdn_norm_out
    # recomputation included (on a GPU: it needs Transformer Engine).
    gdn = dict(experimental_attention_variant="gated_delta_net", recompute_modules=["gdn_norm_out"])
    gdn.update(recompute_granularity="selective")
    check_model_config(config(**gdn), te_available=True, cpu_backend=False)


@pytest.mark.parametrize(
    "overrides,te,flag",
    [
        (dict(calculate_per_token_loss=False), False, "--calculate-per-token-loss"),
        (dict(hybrid_context_parallel=True), False, "--hybrid-context-parallel"),
        (
            dict(
                multi_latent_attention=True,
                recompute_granularity="selective",
                recompute_modules=["mla_up_proj"],
            ),
            False,
            "--recompute-modules mla_up_proj",
        ),
        (dict(sequence_parallel=True), False, "--sequence-parallel"),
        (dict(recompute_granularity="selective", recompute_modules=["mlp"]), True, "bias-linear"),
        (dict(cuda_graph_impl="transformer_engine"), True, "--cuda-graph-impl"),
        (dict(cuda_graph_impl="local"), True, "--cuda-graph-impl"),
        (dict(enable_cuda_graph=True), True, "--enable-cuda-graph"),
        (dict(tp_comm_overlap=True, sequence_parallel=True), True, "--tp-comm-overlap"),
        # On a GPU these layers build and train: DCP's groups would never reach their CP.
        (dict(experimental_attention_variant="dsa"), True, "--experimental-attention-variant dsa"),
        (dict(hybrid_layer_pattern="M*G-"), True, "'G' layers are gated_delta_net"),
        (dict(hybrid_layer_pattern="MD*-"), True, "'D' layers are dsa"),
    ],
)
def test_unsupported_model_settings_are_rejected(overrides, te, flag):
    """On a GPU (``cpu_backend=False``): sequence parallelism without TE is refused."""
    with pytest.raises(ValueError, match=flag):
        check_model_config(config(**overrides), te_available=te, cpu_backend=False)


@pytest.mark.parametrize(
    "overrides,flag",
    [
        (dict(recompute_granularity="selective", recompute_modules=["layernorm"]), "layernorm"),
        (dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"]), "gdn_norm"),
        (dict(fp8="hybrid"), "--fp8-format"),
        (dict(fp4="e2m1"), "--fp4-format"),
    ],
)
def test_settings_that_need_transformer_engine_are_rejected_on_cpu(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        check_model_config(config(**overrides), te_available=False, cpu_backend=True)


def test_scheduler_defaults_to_dcp_and_rejects_unknown_names():
    assert DCPConfig(max_seqlen_per_dp_cp_rank=8).scheduler == "default_dynamic_cp"
    assert DCPConfig(max_seqlen_per_dp_cp_rank=8, scheduler="dp_balanced").scheduler
    with pytest.raises(ValueError, match="--sequence-packing-scheduler='fifo'"):
        DCPConfig(max_seqlen_per_dp_cp_rank=8, scheduler="fifo")


@pytest.mark.parametrize(
    "budget,tp,sp", [(None, 1, False), (0, 1, False), (7, 1, False), (6, 4, True)]
)
def test_budget_must_be_set_and_a_multiple_of_the_padding_unit(budget, tp, sp):
    with pytest.raises(ValueError, match="--max-seqlen-per-dp-cp-rank"):
        check_budget(budget, tp, sp)
    with pytest.raises(ValueError, match="--max-seqlen-per-dp-cp-rank"):
        DCPConfig(max_seqlen_per_dp_cp_rank=budget, tp_size=tp, sequence_parallel=sp)


def test_budget_accepts_multiples_of_the_padding_unit():
    assert DCPConfig(max_seqlen_per_dp_cp_rank=4096).pad_multiple(4) == 8
    assert DCPConfig(max_seqlen_per_dp_cp_rank=8, tp_size=4, sequence_parallel=True)


def config_from_flags(*flags: str) -> DCPConfig:
    """The DCPConfig that ``flags`` (DCP's own) give beside a small model's megatron args."""
    parsed = add_dcp_args(ArgumentParser()).parse_args(list(flags))
    args = SimpleNamespace(
        **vars(parsed),
        micro_batch_size=1,
        max_seqlen_per_dp_cp_rank=64,
        context_parallel_size=2,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
    )
    return DCPConfig.from_args(args)


@pytest.fixture
def registered_scheduler():
    """A scheduler registered for one test only (the registry is global)."""

    class EveryRankItsOwn(DPBalancedScheduler, name="test_every_rank_its_own"):
        """dp_balanced under another name: what a user's plug-in scheduler looks like."""

    yield EveryRankItsOwn
    SCHEDULERS.pop("test_every_rank_its_own")


def test_a_registered_scheduler_can_be_chosen_from_the_command_line(registered_scheduler):
    dcp = config_from_flags(
        "--dynamic-context-parallel", "--sequence-packing-scheduler", registered_scheduler.name
    )
    assert isinstance(dcp.build_scheduler(4), registered_scheduler)
    with pytest.raises(SystemExit):  # argparse: not a registered choice
        add_dcp_args(ArgumentParser()).parse_args(["--sequence-packing-scheduler", "fifo"])


def test_the_flag_reaches_the_config_and_an_unknown_method_is_refused():
    assert config_from_flags().routing == DEFAULT_ROUTING == "auto"
    assert config_from_flags("--dcp-routing", "lane-all-gather").routing == "lane-all-gather"
    assert config_from_flags("--dcp-routing", "all-to-all").routing == "all-to-all"
    with pytest.raises(SystemExit):  # argparse: not a choice
        config_from_flags("--dcp-routing", "ring")
    with pytest.raises(ValueError) as error:
        DCPConfig(max_seqlen_per_dp_cp_rank=64, routing="all_gather")
    assert str(error.value) == (
        "--dcp-routing='all_gather': must be one of auto, all-to-all, lane-all-gather "
        "(DCPConfig.routing)."
    )


def too_long_error() -> SchedulingError:
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8
    )
    with pytest.raises(SchedulingError) as info:
        scheduler.schedule([5, 100])
    return info.value


def test_one_scheduling_error_worded_for_each_layer():
    error = too_long_error()
    assert str(error).startswith("budget=8: sample 1 has 100 tokens")
    assert "Raise budget to at least 26" in str(error) and "--" not in str(error)
    training = str(flag_error(error))
    assert training.startswith("--max-seqlen-per-dp-cp-rank=8: sample 1 has 100 tokens")
    assert "Raise --max-seqlen-per-dp-cp-rank to at least 26" in training
    assert "a smaller --seq-length" in training
    assert error_message(error).startswith("--max-seqlen-per-dp-cp-rank=8: sample 1")


def test_config_errors_name_the_training_flag():
    with pytest.raises(ValueError, match=r"^--min-dynamic-context-parallel-size=4: must be"):
        DCPConfig(max_seqlen_per_dp_cp_rank=8, min_cp_size=4).build_scheduler(2)
    with pytest.raises(ValueError, match=r"^--min-dynamic-context-parallel-size=3: must be"):
        DCPConfig(max_seqlen_per_dp_cp_rank=8, min_cp_size=3)
    with pytest.raises(ValueError, match=r"^--context-parallel-size=3: dp_balanced"):
        DCPConfig(max_seqlen_per_dp_cp_rank=8, cp_size=3, scheduler="dp_balanced").build_scheduler(
            6
        )


@pytest.mark.parametrize(
    "min_cp_size,domain_size,choices",
    [
        (2, 1, "use 1."),
        (4, 2, "use 1 or 2."),
        (8, 4, "use 1, 2 or 4."),
        (16, 12, "use 1, 2, 4 or 8."),
        (128, 64, "use 1, 2, 4, ... up to 64."),
    ],
)
def test_a_too_large_min_cp_size_lists_exactly_the_sizes_the_domain_admits(
    min_cp_size, domain_size, choices
):
    """ "use 1, 2, 4, ... up to N" only when the list is long; "use 1 or 2" on a domain of 2."""
    with pytest.raises(ValueError) as info:
        DCPConfig(max_seqlen_per_dp_cp_rank=8, min_cp_size=min_cp_size).build_scheduler(domain_size)
    assert str(info.value).endswith(f"size {domain_size} (dp {domain_size} × cp 1); {choices}")
