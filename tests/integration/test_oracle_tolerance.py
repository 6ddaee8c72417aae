"""The oracle's tolerances are derived from its own float32 rounding (``testing.oracle``): the
float64 run is really float64, the float32 oracle passes its own check, and a gradient or loss
``PLANTED_FACTOR`` (10) times further from the exact value than the float32 oracle's rounding is
caught, in every tensor."""

import dataclasses

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing.dcp_step import DCPStepResult  # noqa: E402
from megatron_dcp.testing.gpt import TinyGPTOptions, make_samples  # noqa: E402
from megatron_dcp.testing.oracle import (  # noqa: E402
    ERROR_FACTOR,
    FLOAT32_EPS,
    FLOOR_ULPS,
    MEASURED_WORST,
    PLANTED_FACTOR,
    assert_step_matches,
    reference_cache,
)
from megatron_dcp.testing.plan_coverage import Layout  # noqa: E402
from megatron_dcp.testing.precision import largest_magnitude  # noqa: E402

# A hybrid model: the Mamba scan's large gradients are where float32 rounding is largest.
OPTIONS = TinyGPTOptions(num_layers=4, hybrid_layer_pattern="M*M-")


@pytest.fixture(scope="module")
def reference():
    samples = make_samples((37, 5, 120, 64, 9), OPTIONS.vocab_size, seed=11)
    return reference_cache(samples)(OPTIONS)


def as_step(reference, grads, loss_sum=None) -> DCPStepResult:
    loss = reference.loss_sum if loss_sum is None else loss_sum
    return DCPStepResult(loss, reference.num_tokens, (1,), 1, grads, Layout())


def scale(error: float, exact: torch.Tensor) -> float:
    """What the tolerance multiplies: the oracle's error, or the floor."""
    return max(error, FLOOR_ULPS * FLOAT32_EPS * largest_magnitude(exact))


def test_the_factor_sits_between_what_was_measured_and_what_must_be_caught():
    assert MEASURED_WORST < ERROR_FACTOR < PLANTED_FACTOR


def test_the_exact_run_is_float64_and_the_float32_run_rounds(reference):
    exact = reference.exact
    assert all(value.dtype == torch.float64 for value in exact.tensors.values())
    assert all(value.dtype == torch.float32 for value in reference.grads.values())
    assert any(".mixer." in name for name in exact.tensors)  # a hybrid model, as claimed
    assert max(exact.errors.values()) > 0 and exact.loss_error > 0
    assert_step_matches(as_step(reference, reference.grads), reference)


def test_an_error_ten_times_the_oracles_rounding_is_caught_in_every_tensor(reference):
    exact = reference.exact
    for name, value in exact.tensors.items():
        if value.numel() == 0:
            continue
        planted = value.clone()
        planted.view(-1)[0] += PLANTED_FACTOR * scale(exact.errors[name], value)
        grads = dict(exact.tensors, **{name: planted})
        with pytest.raises(AssertionError, match=name):
            assert_step_matches(as_step(reference, grads), reference)


def test_a_loss_ten_times_the_oracles_rounding_away_is_caught(reference):
    exact = reference.exact
    off = PLANTED_FACTOR * scale(exact.loss_error, torch.tensor(exact.loss_sum))
    with pytest.raises(AssertionError, match="loss"):
        assert_step_matches(as_step(reference, exact.tensors, exact.loss_sum + off), reference)


def test_an_oracle_without_its_float64_run_is_refused(reference):
    with pytest.raises(ValueError, match="float64"):
        assert_step_matches(
            as_step(reference, reference.grads), dataclasses.replace(reference, exact=None)
        )
