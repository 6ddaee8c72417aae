"""The comparison every oracle test makes: a distributed step against the single-process run,
with tolerances derived from the oracle's own float32 rounding on the CPU that runs it (and, for
bf16 or fp16 mixed precision, from the mixed-precision oracle's own rounding:
``assert_mixed_precision_*``)."""

from __future__ import annotations

import json
import os
from typing import Callable, List, Mapping, Optional, Sequence

import torch

from megatron_dcp.testing.dcp_step import DCPStepResult, TrainingRunResult
from megatron_dcp.testing.gpt import (
    ReferenceResult,
    Sample,
    TinyGPTOptions,
    make_samples,
    single_process_reference,
)
from megatron_dcp.testing.precision import (
    BF16_EPS,
    FP16_EPS,
    FP16_LOSS_SCALE,
    HALF_DTYPES,
    ExactRun,
    RanPrecision,
    largest_difference,
    largest_magnitude,
)
from megatron_dcp.tools.check.tolerance import (  # noqa: F401 (FLOAT32_EPS: the tests' import)
    ERROR_FACTOR,
    FLOAT32_EPS,
    FLOOR_ULPS,
    floor,
    tolerance,
)

# Three global batches of different lengths: the training-run oracles (weights after Adam steps).
ADAM_LENGTHS = ((37, 5, 120, 64), (200, 9, 33, 71), (16, 150, 90, 2))


# How far a correct float32 run may stray from the exact (float64) oracle, in units of what float32
# rounding did to the oracle itself (``testing.precision``): per tensor, the largest element-wise
# |float32 - float64| over the oracle's two float32 passes (the samples in two orders), floored at
# FLOOR_ULPS units of float32 rounding at the tensor's largest value (for a tensor whose oracle
# rounding happened to vanish). A distributed run adds orders of its own (packing, CP shards, the
# Mamba scan cut into chunks, TP and DP reductions), so it strays a few times further: over the
# oracle tests on 2026-11-26 (17,000 comparisons, an Intel Xeon) the median was 0.36 times the
# oracle's rounding and the worst MEASURED_WORST (a Mamba A_log gradient under static CP 4; every
# other test at most 2.5). Set MEGATRON_DCP_ORACLE_MARGINS=FILE to log every comparison's ratio.
# ERROR_FACTOR leaves room above that for CPUs whose SIMD paths round differently and stays below
# PLANTED_FACTOR: an error that many times the oracle's own rounding is caught, in every tensor
# (tests/integration/test_oracle_tolerance.py). The rule itself, ERROR_FACTOR, FLOOR_ULPS and
# ``tolerance``, is ``tools.check.tolerance``: ``megatron-dcp check`` applies the same one.
MEASURED_WORST = 4.95
PLANTED_FACTOR = 10.0
MARGINS_LOG = "MEGATRON_DCP_ORACLE_MARGINS"


def assert_step_matches(result: DCPStepResult, reference: ReferenceResult) -> None:
    """Token count exact; summed loss and every gradient within :func:`tolerance` of the exact
    oracle (``reference.exact``, the float64 run)."""
    exact = _exact(reference)
    assert result.num_tokens == reference.num_tokens, (result.num_tokens, reference.num_tokens)
    assert result.grads.keys() == exact.tensors.keys()
    assert_within("loss", result.loss_sum, exact.loss_sum, exact.loss_error)
    for name, value in exact.tensors.items():
        assert_tensor_within(name, result.grads[name], value, exact.errors[name])


def assert_runs_agree(
    result: DCPStepResult, other: DCPStepResult, reference: ReferenceResult
) -> None:
    """Two distributed runs of the oracle's samples (DCP against static CP): each within
    :func:`tolerance` of the exact value, so within twice that of each other."""
    exact = _exact(reference)
    assert result.num_tokens == other.num_tokens, (result.num_tokens, other.num_tokens)
    assert result.grads.keys() == other.grads.keys() == exact.tensors.keys()
    assert_within("loss", result.loss_sum, other.loss_sum, 2 * exact.loss_error)
    for name, value in other.grads.items():
        assert_tensor_within(name, result.grads[name], value, 2 * exact.errors[name])


def assert_within(
    name: str, value: float, exact: float, error: float, eps: float = FLOAT32_EPS
) -> None:
    """``eps``: the ulp of the oracle's lower precision (float32; bf16: :data:`BF16_EPS`; fp16:
    :data:`FP16_EPS`)."""
    allowed = tolerance(error, abs(exact), eps)
    _log_margin(name, abs(value - exact), allowed)
    assert abs(value - exact) <= allowed, (
        f"{name}: {value!r} is {abs(value - exact):.3g} from the exact {exact!r}, allowed "
        f"{allowed:.3g} ({ERROR_FACTOR:g} x the {_precision(eps)} oracle's own error {error:.3g})"
    )


def assert_tensor_within(
    name: str, tensor: torch.Tensor, exact: torch.Tensor, error: float, eps: float = FLOAT32_EPS
) -> None:
    assert tensor.shape == exact.shape, (name, tuple(tensor.shape), tuple(exact.shape))
    distance = largest_difference(tensor, exact)
    magnitude = largest_magnitude(exact)
    allowed = tolerance(error, magnitude, eps)
    _log_margin(name, distance, allowed)
    assert distance <= allowed, (
        f"{name}: largest element-wise distance {distance:.3g} from the exact (float64) oracle, "
        f"allowed {allowed:.3g} ({ERROR_FACTOR:g} x the {_precision(eps)} oracle's own error "
        f"{error:.3g}, floor {floor(magnitude, eps):.3g}: {FLOOR_ULPS:g} ulps of "
        f"{magnitude:.3g}, capped)"
    )


def _precision(eps: float) -> str:
    return {FLOAT32_EPS: "float32", BF16_EPS: "bf16", FP16_EPS: "fp16"}.get(eps, f"eps-{eps:g}")


def _exact(reference: ReferenceResult) -> ExactRun:
    if reference.exact is None:
        raise ValueError("the oracle has no float64 run: build it with single_process_reference")
    return reference.exact


def _log_margin(name: str, distance: float, allowed: float) -> None:
    """With MEGATRON_DCP_ORACLE_MARGINS set: append the comparison's distance in units of the
    float32 oracle's error (allowed / ERROR_FACTOR), with the test that made it."""
    path = os.environ.get(MARGINS_LOG)
    if path:
        ratio = distance * ERROR_FACTOR / allowed if allowed else 0.0
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as log:
            log.write(json.dumps({"test": test, "name": name, "ratio": ratio}) + "\n")


def reference_cache(
    samples: Sequence[Sample],
    run: Callable[[Sequence[Sample], TinyGPTOptions], ReferenceResult] = single_process_reference,
) -> Callable[[TinyGPTOptions], ReferenceResult]:
    """The single-process run of ``samples`` by model options, each model run once: a test
    module compares many layouts against the same few models (a module-scoped fixture holds it).
    Options that only change how the step runs (recomputation) still make a new entry, so pass
    the model without them. ``run``: the oracle (``gpt.mixed_precision_reference`` for bf16)."""
    cache: dict[TinyGPTOptions, ReferenceResult] = {}

    def reference(options: TinyGPTOptions) -> ReferenceResult:
        if options not in cache:
            cache[options] = run(samples, options)
        return cache[options]

    return reference


def adam_batches(vocab_size: int) -> List[List[Sample]]:
    """The samples of :data:`ADAM_LENGTHS`, one list per global batch."""
    return [make_samples(batch, vocab_size, seed=s) for s, batch in enumerate(ADAM_LENGTHS)]


def assert_weights_match(
    weights: Mapping[str, torch.Tensor], expected: ExactRun, eps: float = FLOAT32_EPS
) -> None:
    """Weights after a few Adam steps within :func:`tolerance` of the float64 oracle's
    (``dcp_step.reference_training_run``). Adam turns float noise in near-zero gradients into
    full-size updates (m/√v, up to the learning rate per step); the float32 oracle's own error
    measures that too. ``eps``: the oracle's lower precision (bf16, fp16: the weights of a
    mixed-precision run against ``dcp_step.mixed_precision_reference_training_run``)."""
    assert weights.keys() == expected.tensors.keys()
    for name, value in expected.tensors.items():
        assert_tensor_within(name, weights[name], value, expected.errors[name], eps)


# ------------------------------------------------------------------------------------------------
# Mixed precision: bf16, fp16 with its loss scaler
# ------------------------------------------------------------------------------------------------


def assert_mixed_precision_step_matches(
    result: DCPStepResult, reference: ReferenceResult, eps: float = BF16_EPS
) -> None:
    """A mixed-precision step (``dcp_step.dcp_mixed_precision_step``) against the exact values
    of ``gpt.mixed_precision_reference``: token count exact; summed loss and every float32
    ``main_grad`` (unscaled) within :func:`tolerance` of them, the rounding measured on the
    mixed-precision oracle and the floor in ulps of ``eps`` (bf16's; fp16: :data:`FP16_EPS`).
    megatron's ``main_grad`` is the gradient of the per-token loss (the sum over the global token
    count), so the oracle's sums and their rounding are divided by the count first."""
    exact = _exact(reference)
    count = reference.num_tokens
    assert result.num_tokens == count, (result.num_tokens, count)
    assert result.grads.keys() == exact.tensors.keys()
    assert_within("loss", result.loss_sum, exact.loss_sum, exact.loss_error, eps)
    for name, value in exact.tensors.items():
        error = exact.errors[name] / count
        assert_tensor_within(name, result.grads[name], value / count, error, eps)


def assert_ran_mixed_precision(
    result: DCPStepResult | TrainingRunResult,
    optimizer: Optional[str] = None,
    half_precision: str = "bf16",
) -> None:
    """The run computed in megatron's mixed precision in ``half_precision``: its model chunks
    were megatron's Float16Module inside DDP, every parameter of the half type and every
    ``main_grad`` float32; its loss scaler megatron's dynamic one at :data:`FP16_LOSS_SCALE` in
    fp16 (still there after the run: no scale-down), none in bf16; with ``optimizer`` (a
    megatron class name) that optimizer updated float32 main copies."""
    ran: Optional[RanPrecision] = result.precision
    assert ran is not None, "the run did not record its precision"
    assert ran.wrappers[:2] == ("DistributedDataParallel", "Float16Module"), ran.wrappers
    assert ran.param_dtypes == {str(HALF_DTYPES[half_precision])}, ran.param_dtypes
    assert ran.main_grad_dtypes == {"torch.float32"}, ran.main_grad_dtypes
    scaler = ("DynamicGradScaler", FP16_LOSS_SCALE) if half_precision == "fp16" else None
    assert ran.grad_scalers == {scaler}, ran.grad_scalers
    if optimizer is not None:
        assert ran.optimizers == {optimizer}, ran.optimizers
        assert ran.main_param_dtypes == {"torch.float32"}, ran.main_param_dtypes
