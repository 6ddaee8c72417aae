"""A hybrid Mamba model (megatron's ``HybridModel``: Mamba, attention and MLP layers) trained
under DCP equals the single-process run without CP or packing: loss and token count, every
gradient, and the weights after three DDP + Adam steps, on CPU with the reference Mamba kernels
and attention; the static-CP baseline (``dp_balanced``) too.

The tolerances are derived from the oracle's own float32 rounding (``testing.oracle``): the Mamba
scan makes gradients of hundreds, whose rounding reaches the small entries of the same tensor."""

from functools import partial

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing.dcp_step import (  # noqa: E402
    dcp_training_run,
    dcp_training_step,
    reference_training_run,
)
from megatron_dcp.testing.gpt import TinyGPTOptions, make_samples  # noqa: E402
from megatron_dcp.testing.oracle import (  # noqa: E402
    adam_batches,
    assert_step_matches,
    assert_weights_match,
    reference_cache,
)
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

# With budget 64 on N = 4: 200 needs the whole domain, 120 and 71 two ranks, the rest one.
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
PATTERN = "M*M-"
OPTIONS = TinyGPTOptions(num_layers=len(PATTERN), hybrid_layer_pattern=PATTERN)
# Pipeline stages split the pattern at '|' (the same layers, numbered alike).
STAGED = TinyGPTOptions(num_layers=len(PATTERN), hybrid_layer_pattern="M*|M-")

# id: (tp, pp, cp, budget); world 4. A domain of 2 ranks (tp2, pp2) needs budget 128 for 200.
LAYOUTS = {
    "dp2cp2": (1, 1, 2, 64),
    "cp4": (1, 1, 4, 64),
    "tp2cp2": (2, 1, 2, 128),
    "pp2cp2": (1, 2, 2, 128),
}


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, OPTIONS.vocab_size, seed=11)


@pytest.fixture(scope="module")
def reference(samples):
    return reference_cache(samples)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_step_equals_single_process(samples, reference, layout):
    tp, pp, cp, budget = LAYOUTS[layout]
    options = STAGED if pp > 1 else OPTIONS
    step = partial(dcp_training_step, tp=tp, pp=pp, cp=cp, budget=budget, options=options)
    results = run_distributed(step, 4, samples, timeout_s=240)
    assert_covers(results, Layout(tp=tp, pp=pp, dp=4 // (tp * pp * cp), cp=cp))  # a mix
    for result in results:
        assert_step_matches(result, reference(OPTIONS))
        assert any(".mixer." in name for name in result.grads)


@pytest.mark.parametrize("cp", [2, 4])
def test_static_cp_equals_single_process(samples, reference, cp):
    """dp_balanced: every sequence on the static CP group (budget 100: CP 2 holds 200 tokens)."""
    step = partial(dcp_training_step, cp=cp, budget=100, options=OPTIONS, scheduler="dp_balanced")
    results = run_distributed(step, 4, samples, timeout_s=240)
    assert_covers(results, Layout(dp=4 // cp, cp=cp), cp_sizes={cp})
    for result in results:
        assert_step_matches(result, reference(OPTIONS))


def test_weights_after_three_adam_steps_equal_single_process():
    batches = adam_batches(OPTIONS.vocab_size)
    (expected,) = run_distributed(reference_training_run, 1, batches, OPTIONS, timeout_s=240)
    run = partial(dcp_training_run, cp=2, budget=64, options=OPTIONS)
    results = run_distributed(run, 4, batches, timeout_s=240)
    assert_covers(results, Layout(dp=2, cp=2))
    for result in results:
        assert_weights_match(result.weights, expected)
