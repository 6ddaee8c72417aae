"""bf16 and fp16 mixed precision under DCP (CPU, gloo) against the float64 single-process oracle.

The distributed side is megatron's own bf16 recipe, as megatron.training builds it with
``--bf16``: the chunks built in bf16, in megatron's Float16Module and DDP with float32 gradient
accumulation, ``finalize_model_grads`` at the end of the schedule, and megatron's mixed-precision
optimizers (``Float16OptimizerWithFloat16Params``, the distributed optimizer) for the Adam runs
(``testing.dcp_step``); the fp16 tests the same with ``--fp16`` and its dynamic loss scaler (the
optimizer's ``scale_loss`` scaling the loss in the schedule's backward, the optimizer unscaling
the float32 gradients, starting at 2**7). Each test asserts that it ran that recipe
(``assert_ran_mixed_precision``) and the CP sizes it claims (``assert_covers``).

The oracle shares no code with the runtime: megatron's model on one rank, every sample on its
own, in float64 (the exact values) and in bf16 (fp16, its loss scaled by the same scale) mixed
precision in two sample orders, which measures the half precision's rounding
(``gpt.mixed_precision_reference``, ``dcp_step.mixed_precision_reference_training_run``). A
quantity passes within ``ERROR_FACTOR`` times that rounding, floored at the half precision's ulps
capped at ``FLOOR_CAP`` of its magnitude (``tools.check.tolerance``; tests/README.md, "bf16
oracle tolerances").
"""

import dataclasses
from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA"),
]

from megatron_dcp.testing.dcp_step import (  # noqa: E402
    dcp_mixed_precision_step,
    dcp_training_run,
    mixed_precision_reference_training_run,
)
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    make_samples,
    mixed_precision_reference,
)
from megatron_dcp.testing.oracle import (  # noqa: E402
    adam_batches,
    assert_mixed_precision_step_matches,
    assert_ran_mixed_precision,
    assert_weights_match,
    reference_cache,
)
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402
from megatron_dcp.testing.precision import BF16_EPS, FP16_EPS  # noqa: E402

# As test_dcp_oracle.py: with a budget of 100 tokens per rank the 200- and 120-token samples need
# a group of 2, the short ones fit on one rank, so every plan mixes CP sizes (budget 64: and 4).
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
BUDGET = 100
OPTIONS = TinyGPTOptions(num_layers=2)
MOE = TinyGPTOptions(
    num_layers=2,
    add_bias_linear=False,  # megatron's SequentialMLP experts fail with linear biases
    num_moe_experts=4,
    moe_router_topk=2,
    expert_parallel=2,
)
# The half precisions (the bf16 step tests pass OPTIONS: the step and its oracle default to bf16).
BF16 = dataclasses.replace(OPTIONS, half_precision="bf16")
FP16 = dataclasses.replace(OPTIONS, half_precision="fp16")
# Adam's epsilon for the bf16 training runs. Adam moves a weight by about the learning rate for
# any gradient much larger than epsilon (m/√v ≈ ±1), so with megatron's default 1e-8 the bf16
# rounding of the per-token gradients near zero (up to 6e-4 here: the oracle's measured
# ``errors`` over its token count) becomes a full step of either sign: 13 of the 28 weights'
# tolerances (8 times that) were over CEILING (5 %) of their magnitude: they could not fail. With an
# epsilon above that rounding it moves a weight by at most lr·rounding/epsilon, and every
# weight's tolerance is under 5 % of its magnitude (measured: at most 4.7 %). fp16 too.
ADAM_EPS = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
    """A layout at world 4, and the model options it runs."""

    name: str
    tp: int = 1
    pp: int = 1
    cp: int = 2
    options: TinyGPTOptions = OPTIONS

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=4 // (self.tp * self.pp * self.cp), cp=self.cp)

    @property
    def reference_options(self) -> TinyGPTOptions:
        """The oracle's model: sequence parallelism is how TP runs, not another model."""
        return dataclasses.replace(self.options, sequence_parallel=False)


CASES = [
    Case("dp2cp2"),
    Case("tp2cp2-sp", tp=2, options=dataclasses.replace(OPTIONS, sequence_parallel=True)),
    Case("pp2cp2", pp=2),
]


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, OPTIONS.vocab_size, seed=7)


@pytest.fixture(scope="module")
def reference_of(samples):
    return reference_cache(samples, mixed_precision_reference)


def run_step(case: Case, samples, scheduler: str = "default_dynamic_cp"):
    step = partial(
        dcp_mixed_precision_step,
        tp=case.tp,
        pp=case.pp,
        cp=case.cp,
        scheduler=scheduler,
        budget=BUDGET,
        options=case.options,
    )
    return run_distributed(step, 4, samples, timeout_s=240)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bf16_dcp_step_equals_single_process(case, samples, reference_of):
    """DCP plans mixing CP sizes, in bf16 mixed precision: loss, token count and every float32
    main_grad within the bf16 tolerances of the exact values."""
    results = run_step(case, samples)
    assert_covers(results, case.layout)
    for result in results:
        assert_ran_mixed_precision(result)
        assert_mixed_precision_step_matches(result, reference_of(case.reference_options))


def test_bf16_static_cp_baseline_equals_single_process(samples, reference_of):
    """The static-CP baseline (``dp_balanced``) at dp2·cp2 in bf16: every group the static CP
    group of 2."""
    case = CASES[0]
    results = run_step(case, samples, scheduler="dp_balanced")
    assert_covers(results, case.layout, cp_sizes={2})
    for result in results:
        assert_ran_mixed_precision(result)
        assert_mixed_precision_step_matches(result, reference_of(case.reference_options))


def test_bf16_moe_step_equals_single_process(samples, reference_of):
    """MoE (4 local experts, top-2, alltoall dispatcher, EP 2 inside dp2·cp2) in bf16: groups of
    1, 2 and 4 ranks in one step (budget 64)."""
    moe = Case("moe", options=MOE)
    step = partial(dcp_mixed_precision_step, cp=2, budget=64, options=MOE)
    results = run_distributed(step, 4, samples, timeout_s=240)
    assert_covers(results, moe.layout, mix_of={1, 2, 4})
    for result in results:
        assert_ran_mixed_precision(result)
        assert_mixed_precision_step_matches(result, reference_of(moe.reference_options))


def test_fp16_dcp_step_with_the_loss_scale_equals_single_process(samples, reference_of):
    """A DCP step at dp2·cp2 mixing CP sizes in fp16 with megatron's loss scaler: the loss scaled
    by 2**7 in the backward, every float32 main_grad over that scale within the fp16 tolerances
    of the exact values. (One layout: what fp16 adds, the loss scale and fp16's rounding, does
    not depend on it; the bf16 tests cover the layouts.)"""
    results = run_step(Case("fp16", options=FP16), samples)
    assert_covers(results, CASES[0].layout)
    for result in results:
        assert_ran_mixed_precision(result, half_precision="fp16")
        assert_mixed_precision_step_matches(result, reference_of(FP16), FP16_EPS)


def adam_reference_of(options: TinyGPTOptions):
    """The oracle of three Adam steps in ``options``' mixed precision (float64, and the half
    precision twice)."""
    batches = adam_batches(OPTIONS.vocab_size)
    reference = partial(mixed_precision_reference_training_run, adam_eps=ADAM_EPS)
    (expected,) = run_distributed(reference, 1, batches, options, timeout_s=240)
    return batches, expected


def adam_run(options: TinyGPTOptions, distributed_optimizer: bool, batches):
    """Three DCP Adam steps of ``batches`` at dp2·cp2 in ``options``' mixed precision."""
    run = partial(
        dcp_training_run,
        cp=2,
        budget=64,
        options=options,
        distributed_optimizer=distributed_optimizer,
        adam_eps=ADAM_EPS,
    )
    results = run_distributed(run, 4, batches, timeout_s=240)
    assert_covers(results, CASES[0].layout)
    return results


@pytest.fixture(scope="module")
def adam_reference():
    return adam_reference_of(BF16)


@pytest.fixture(scope="module")
def fp16_adam_reference():
    return adam_reference_of(FP16)


OPTIMIZERS = pytest.mark.parametrize(
    "distributed_optimizer, optimizer",
    [(True, "DistributedOptimizer"), (False, "Float16OptimizerWithFloat16Params")],
    ids=["distributed_optimizer", "float16_optimizer"],
)


@OPTIMIZERS
def test_bf16_adam_steps_equal_single_process(distributed_optimizer, optimizer, adam_reference):
    """Three Adam steps at dp2·cp2 in bf16 with megatron's mixed-precision optimizers (float32
    main weights, sharded over DP×CP by the distributed optimizer): the bf16 weights afterwards
    within the bf16 tolerances of the float64 run's."""
    batches, expected = adam_reference
    for result in adam_run(BF16, distributed_optimizer, batches):
        assert_ran_mixed_precision(result, optimizer)
        assert_weights_match(result.weights, expected, BF16_EPS)


@OPTIMIZERS
def test_fp16_adam_steps_with_the_loss_scaler_equal_single_process(
    distributed_optimizer, optimizer, fp16_adam_reference
):
    """Three Adam steps at dp2·cp2 in fp16 with megatron's mixed-precision optimizers and its
    dynamic loss scaler (from 2**7): every step updated the weights (none skipped for an
    overflow), and the fp16 weights afterwards are within the fp16 tolerances of the float64
    run's."""
    batches, expected = fp16_adam_reference
    for result in adam_run(FP16, distributed_optimizer, batches):
        assert_ran_mixed_precision(result, optimizer, half_precision="fp16")
        assert result.updates == (True,) * len(batches), result.updates
        assert_weights_match(result.weights, expected, FP16_EPS)
