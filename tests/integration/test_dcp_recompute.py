"""Megatron's activation recomputation under DCP (CPU, gloo): a DCP step with full or selective
recomputation equals the single-process run without CP and without recomputation — summed loss
(relative 1e-5), token count (exact) and every gradient (1e-4).

Recomputation re-runs a forward inside the backward pass, long after the micro-batch's own
forward: the re-run must use that micro-batch's CP group again (its ``packed_seq_params``), not
the static one nor that of the micro-batch running at the time. Every step therefore mixes
micro-batches without CP (size 1) with micro-batches on the largest group of the domain, and
each test also counts the forwards that ran inside a backward pass, so that a configuration
which silently recomputes nothing cannot pass.
"""

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import DistributedTestError, run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA"),
]

from megatron.core.extensions.transformer_engine import HAVE_TE  # noqa: E402

from megatron_dcp.testing.dcp_step import DCPStepResult, dcp_training_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    build_tiny_gpt,
    init_megatron,
    make_samples,
    tiny_gpt_config,
    unpacked_loss_and_backward,
)
from megatron_dcp.testing.oracle import assert_step_matches, reference_cache  # noqa: E402
from megatron_dcp.testing import plan_coverage  # noqa: E402

# test_dcp_oracle's lengths with 12 for 71: then the model's cost model plans the 64-token sample
# alone on one rank (a group of 1) in the step where 200 + 33 take a group of the whole domain.
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 12)
OPTIONS = TinyGPTOptions(num_layers=4)
# megatron-core 0.19.2's "mlp" recompute never finishes the backward when the MLP returns its
# output bias (test_mlp_recompute_with_bias_rebinds_the_bias below): those cases run without
# linear biases, against a reference without them.
NO_BIAS = TinyGPTOptions(num_layers=4, add_bias_linear=False)


@dataclass(frozen=True)
class Layout:
    """A parallel layout and a budget under which one step mixes CP sizes 1 and ``largest``."""

    name: str
    world: int
    pp: int
    budget: int
    largest: int  # the whole DCP domain (dp·cp)
    cp: int = 2

    def __str__(self) -> str:
        return self.name

    @property
    def layers_per_stage(self) -> int:
        return OPTIONS.num_layers // self.pp

    @property
    def claimed(self) -> plan_coverage.Layout:
        return plan_coverage.Layout(pp=self.pp, dp=self.world // (self.pp * self.cp), cp=self.cp)


# Budget 64 on N = 4: the 200-token sample needs all 4 ranks, 64 and shorter fit one rank.
# pp2·cp2 leaves a domain of 2 (its largest group), so 100 makes 200 need both ranks.
DP2CP2 = Layout("dp2cp2", world=4, pp=1, budget=64, largest=4)
PP2CP2 = Layout("pp2cp2", world=4, pp=2, budget=100, largest=2)
PP2DP2CP2 = Layout("pp2dp2cp2", world=8, pp=2, budget=64, largest=4)


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, OPTIONS.vocab_size, seed=7)


@pytest.fixture(scope="module")
def reference_of(samples):
    return reference_cache(samples)  # no CP, no recomputation: pass the model without it


@pytest.fixture(scope="module")
def reference(reference_of):
    return reference_of(OPTIONS)


def counted_step(rank: int, world_size: int, samples, **step) -> tuple[DCPStepResult, dict]:
    """``dcp_training_step``, plus how many forwards of each module class ran inside a backward
    pass (a recomputation: without one no module runs forward during backward)."""
    recomputed: Counter = Counter()

    def count(module, inputs, output) -> None:
        if torch._C._current_graph_task_id() != -1:
            recomputed[type(module).__name__] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        result = dcp_training_step(rank, world_size, samples, **step)
    finally:
        handle.remove()
    return result, dict(recomputed)


def run_recompute_step(
    layout: Layout, samples, model: TinyGPTOptions = OPTIONS, **recompute
) -> list[tuple[DCPStepResult, dict]]:
    """A DCP step of ``model`` with the recomputation settings ``recompute``."""
    options = dataclasses.replace(model, **recompute)
    step = partial(counted_step, pp=layout.pp, cp=layout.cp, budget=layout.budget, options=options)
    return run_distributed(step, layout.world, samples, timeout_s=120)


def assert_equal_with_mixed_cp(
    results: list[tuple[DCPStepResult, dict]], reference, layout: Layout
) -> None:
    """The plan mixes CP size 1 with the largest; every rank's step equals ``reference``."""
    ran = [result for result, _ in results]
    plan_coverage.assert_covers(ran, layout.claimed, mix_of={1, layout.largest})
    for result, _ in results:
        assert_step_matches(result, reference)


FULL = [("uniform", 1), ("uniform", 2), ("block", 1), ("block", 2)]


@pytest.mark.parametrize("method,num_layers", FULL, ids=[f"{m}{n}" for m, n in FULL])
@pytest.mark.parametrize("layout", [DP2CP2, PP2CP2], ids=str)
def test_full_recompute_equals_single_process(layout, method, num_layers, samples, reference):
    """``uniform`` re-runs every layer (in chunks of ``num_layers``); ``block`` re-runs the first
    ``num_layers`` layers of each pipeline stage and keeps the others' activations."""
    results = run_recompute_step(
        layout,
        samples,
        recompute_granularity="full",
        recompute_method=method,
        recompute_num_layers=num_layers,
    )
    per_microbatch = layout.layers_per_stage if method == "uniform" else num_layers
    assert_equal_with_mixed_cp(results, reference, layout)
    for result, recomputed in results:
        assert recomputed["TransformerLayer"] == per_microbatch * result.num_microbatches


# What each selective module re-runs per layer and micro-batch, by module class.
SELECTIVE = {"core_attn": {"ReferenceCoreAttention": 1}, "mlp": {"MLP": 1}}
SELECTIVE_CASES = [("core_attn",), ("mlp",), ("core_attn", "mlp")]


@pytest.mark.parametrize("modules", SELECTIVE_CASES, ids="+".join)
@pytest.mark.parametrize("layout", [DP2CP2, PP2CP2], ids=str)
def test_selective_recompute_equals_single_process(layout, modules, samples, reference_of):
    model = NO_BIAS if "mlp" in modules else OPTIONS
    results = run_recompute_step(
        layout, samples, model, recompute_granularity="selective", recompute_modules=modules
    )
    expected = Counter()
    for module in modules:
        expected.update(SELECTIVE[module])
    assert_equal_with_mixed_cp(results, reference_of(model), layout)
    for result, recomputed in results:
        per_step = layout.layers_per_stage * result.num_microbatches
        assert {name: recomputed.get(name, 0) for name in expected} == {
            name: count * per_step for name, count in expected.items()
        }
        assert "TransformerLayer" not in recomputed


def test_recompute_with_cp4_next_to_cp1_in_a_pipeline(samples, reference):
    """pp2·dp2·cp2: a pipeline whose DCP domain (4) holds a group of 4 next to groups of 1
    (pp2·cp2 has a domain of 2), with full recomputation of the first layer of each stage."""
    results = run_recompute_step(
        PP2DP2CP2,
        samples,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=1,
    )
    assert_equal_with_mixed_cp(results, reference, PP2DP2CP2)
    for result, recomputed in results:
        assert recomputed["TransformerLayer"] == result.num_microbatches


@pytest.mark.parametrize(
    "module,needs",
    [
        ("moe_act", "moe_grouped_gemm"),
        ("mla_up_proj", "multi_latent_attention"),
        ("gdn_norm_out", "gated_delta_net"),
    ],
)
def test_recompute_modules_of_other_models_are_refused(module, needs):
    """Megatron refuses, at configuration, the selective modules a dense GPT does not have."""
    options = TinyGPTOptions(recompute_granularity="selective", recompute_modules=(module,))
    with pytest.raises(ValueError, match=needs):
        tiny_gpt_config(1, 1, 1, None, options)


# ------------------------------------------------------------------------------------------------
# megatron-core 0.19.2 limitations, with or without DCP (one process, no CP). Each of these fails
# once megatron fixes the behaviour: then cover the module in the tests above instead.
# ------------------------------------------------------------------------------------------------


def bias_is_leaf_after_forward(rank: int, world_size: int, samples, options) -> bool:
    init_megatron(seed=options.seed)
    (model,) = build_tiny_gpt(options=options)
    sample = samples[0]
    model(
        input_ids=sample["tokens"].view(1, -1),
        position_ids=torch.arange(sample["tokens"].numel()).view(1, -1),
        attention_mask=None,
        labels=sample["labels"].view(1, -1),
    )
    return model.decoder.layers[0].mlp.linear_fc2.bias.is_leaf


def one_sample_backward(rank: int, world_size: int, samples, options) -> None:
    init_megatron(seed=options.seed)
    (model,) = build_tiny_gpt(options=options)
    unpacked_loss_and_backward(model, samples[:1])


def test_mlp_recompute_with_bias_rebinds_the_bias(samples):
    """``tensor_parallel.checkpoint`` returns the MLP's (output, bias) from an autograd Function,
    and torch then gives the bias *parameter itself* the checkpoint as its grad_fn; the
    recomputation re-enters that checkpoint through the bias, over and over, so the backward
    never ends. (Forward only here: the backward would hang.)"""
    options = dataclasses.replace(
        OPTIONS, num_layers=1, recompute_granularity="selective", recompute_modules=("mlp",)
    )
    assert run_distributed(bias_is_leaf_after_forward, 1, samples, options) == [False]


@pytest.mark.skipif(HAVE_TE, reason="the NameError needs Transformer Engine to be absent")
def test_layernorm_recompute_needs_transformer_engine(samples):
    """``CheckpointWithoutOutput()`` sets ``fp8 = (False is not None)``, i.e. True, and then asks
    Transformer Engine's FP8GlobalStateManager: a NameError without TE (so on CPU)."""
    options = dataclasses.replace(
        NO_BIAS, num_layers=1, recompute_granularity="selective", recompute_modules=("layernorm",)
    )
    with pytest.raises(DistributedTestError, match="FP8GlobalStateManager"):
        run_distributed(one_sample_backward, 1, samples, options, timeout_s=60)
