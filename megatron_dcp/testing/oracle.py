"""The comparison every oracle test makes: a distributed step against the single-process run."""

from __future__ import annotations

import math
from typing import Callable, List, Mapping, Sequence

import torch

from megatron_dcp.testing.dcp_step import DCPStepResult
from megatron_dcp.testing.gpt import (
    ReferenceResult,
    Sample,
    TinyGPTOptions,
    make_samples,
    single_process_reference,
)

# Three global batches of different lengths: the training-run oracles (weights after Adam steps).
ADAM_LENGTHS = ((37, 5, 120, 64), (200, 9, 33, 71), (16, 150, 90, 2))


def assert_step_matches(
    result: DCPStepResult, reference: ReferenceResult, scaled_atol: bool = False
) -> None:
    """Token count exact, summed loss within 1e-5 relative, every gradient within rtol 1e-4 /
    atol 1e-5: the tolerances of fp32 sums taken in another order (packing, CP, TP).
    ``scaled_atol``: atol 1e-5 × the tensor's largest gradient (≥ 1), for models whose
    gradients reach hundreds (the Mamba scan): small entries of a large tensor then carry the
    large entries' rounding."""
    assert result.num_tokens == reference.num_tokens, (result.num_tokens, reference.num_tokens)
    assert math.isclose(result.loss_sum, reference.loss_sum, rel_tol=1e-5), (
        result.loss_sum,
        reference.loss_sum,
    )
    assert result.grads.keys() == reference.grads.keys()
    for name, grad in reference.grads.items():
        atol = 1e-5 * max(1.0, float(grad.abs().max())) if scaled_atol else 1e-5
        torch.testing.assert_close(result.grads[name], grad, rtol=1e-4, atol=atol, msg=name)


def reference_cache(samples: Sequence[Sample]) -> Callable[[TinyGPTOptions], ReferenceResult]:
    """The single-process run of ``samples`` by model options, each model run once: a test
    module compares many layouts against the same few models (a module-scoped fixture holds it).
    Options that only change how the step runs (recomputation) still make a new entry, so pass
    the model without them."""
    cache: dict[TinyGPTOptions, ReferenceResult] = {}

    def reference(options: TinyGPTOptions) -> ReferenceResult:
        if options not in cache:
            cache[options] = single_process_reference(samples, options)
        return cache[options]

    return reference


def adam_batches(vocab_size: int) -> List[List[Sample]]:
    """The samples of :data:`ADAM_LENGTHS`, one list per global batch."""
    return [make_samples(batch, vocab_size, seed=s) for s, batch in enumerate(ADAM_LENGTHS)]


def assert_weights_match(
    weights: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> None:
    """Weights after a few Adam steps against the single-process run's, within 1e-4: Adam turns
    float noise in near-zero gradients into full-size updates (m/√v), and each step moves a
    weight by up to the learning rate, 1e-2."""
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-4, msg=name)
