"""Start-up validation: each unsupported setting is a ValueError naming the flag and the fix."""

from types import SimpleNamespace

import pytest

from megatron_dcp.integration.validation import (
    validate_budget,
    validate_model_config,
    validate_scheduler_name,
)

GOOD = dict(
    calculate_per_token_loss=True,
    hybrid_context_parallel=False,
    multi_latent_attention=False,
    sequence_parallel=False,
)


def config(**overrides):
    return SimpleNamespace(**{**GOOD, **overrides})


def test_a_supported_config_passes():
    validate_model_config(config(), te_available=False)
    validate_model_config(config(sequence_parallel=True), te_available=True)


@pytest.mark.parametrize(
    "overrides,te,flag",
    [
        (dict(calculate_per_token_loss=False), False, "--calculate-per-token-loss"),
        (dict(hybrid_context_parallel=True), False, "--hybrid-context-parallel"),
        (dict(multi_latent_attention=True), False, "--multi-latent-attention"),
        (dict(sequence_parallel=True), False, "--sequence-parallel"),
    ],
)
def test_unsupported_model_settings_are_rejected(overrides, te, flag):
    with pytest.raises(ValueError, match=flag):
        validate_model_config(config(**overrides), te_available=te)


def test_scheduler_defaults_to_dcp_and_rejects_unknown_names():
    assert validate_scheduler_name(None) == "default_dynamic_cp"
    assert validate_scheduler_name("dp_balanced") == "dp_balanced"
    with pytest.raises(ValueError, match="--sequence-packing-scheduler='fifo'"):
        validate_scheduler_name("fifo")


@pytest.mark.parametrize(
    "budget,tp,sp", [(None, 1, False), (0, 1, False), (7, 1, False), (6, 4, True)]
)
def test_budget_must_be_set_and_a_multiple_of_the_padding_unit(budget, tp, sp):
    with pytest.raises(ValueError, match="--max-seqlen-per-dp-cp-rank"):
        validate_budget(budget, tp, sp)


def test_budget_accepts_multiples_of_the_padding_unit():
    assert validate_budget(4096, 1, False) == 4096
    assert validate_budget(8, 4, True) == 8
