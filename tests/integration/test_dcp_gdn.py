"""A Gated DeltaNet hybrid (Qwen3-Next-like: GDN layers with standard attention every
``--linear-attention-freq``-th layer) trained under DCP equals the single-process run without CP
or packing: loss and token count, and every gradient, on CPU with the reference GDN kernels and
attention; the plan mixes CP sizes (asserted), and the model has the layers asked for.

The tolerances are derived from the oracle's own float32 rounding (``testing.oracle``)."""

import dataclasses
from functools import partial

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing.dcp_step import dcp_training_step  # noqa: E402
from megatron_dcp.testing.gpt import TinyGPTOptions, make_samples  # noqa: E402
from megatron_dcp.testing.oracle import assert_step_matches, reference_cache  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

# With budget 64 on N = 4: 200 needs the whole domain, 120 and 71 two ranks, the rest one.
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
# Four layers: GDN, GDN, GDN, attention (every 4th is standard attention).
OPTIONS = TinyGPTOptions(num_layers=4, linear_attention_freq=4, add_bias_linear=False)
GDN_LAYERS = (0, 1, 2)

# id: (tp, cp, budget, options); world 4. TP 2 leaves a domain of 2 ranks: budget 128 holds 200
# on both. With TP, sequence parallelism: megatron-core 0.19.2 sums the GDN output norm's weight
# gradient over TP only for sequence-parallel norms (without it every TP rank keeps the share of
# its own heads, with or without DCP; docs/models.md).
LAYOUTS = {
    "dp2cp2": (1, 2, 64, OPTIONS),
    "tp2cp2": (2, 2, 128, dataclasses.replace(OPTIONS, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, OPTIONS.vocab_size, seed=11)


@pytest.fixture(scope="module")
def reference(samples):
    return reference_cache(samples)


def gdn_parameter_names(layer: int) -> set:
    """The parameters of one GDN layer of the tiny model (local modules: the input norm is the
    layer's own; no linear biases)."""
    prefix = f"decoder.layers.{layer}."
    mixer = {"in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "out_norm.weight"}
    mixer |= {"out_norm.bias", "out_proj.weight"}
    return {prefix + "input_layernorm." + p for p in ("weight", "bias")} | {
        prefix + "self_attention." + name for name in mixer
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gdn_step_equals_single_process(samples, reference, layout):
    tp, cp, budget, options = LAYOUTS[layout]
    step = partial(dcp_training_step, tp=tp, cp=cp, budget=budget, options=options)
    results = run_distributed(step, 4, samples, timeout_s=240)
    assert_covers(results, Layout(tp=tp, dp=4 // (tp * cp), cp=cp))  # a mix of CP sizes
    for result in results:
        assert_step_matches(result, reference(OPTIONS))
        for layer in GDN_LAYERS:  # the GDN layers were built and trained
            assert gdn_parameter_names(layer) <= set(result.grads)
        assert "decoder.layers.3.self_attention.linear_qkv.weight" in result.grads
