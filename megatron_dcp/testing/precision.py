"""The float32 rounding error of an oracle run, measured: the same single-process run in float64
(exact, to float32's eyes) and in float32 in two sample orders. How far a correct distributed
float32 run may stray from the exact values is then a multiple of what float32 rounding did to
the oracle itself (``testing.oracle``), on whatever CPU runs the test."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch

Tensors = Mapping[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ExactRun:
    """A run in float64 (loss and tensors by global name) with the float32 runs' error: per
    tensor the largest element-wise |float32 - float64| over the float32 runs, and the same for
    the loss."""

    loss_sum: float
    tensors: dict[str, torch.Tensor] = dataclasses.field(repr=False)
    loss_error: float
    errors: dict[str, float] = dataclasses.field(repr=False)


def exact_run(
    exact_loss: float, exact: Tensors, float32_runs: Sequence[tuple[float, Tensors]]
) -> ExactRun:
    """The float64 run ``(exact_loss, exact)`` and what each float32 run ``(loss, tensors)``
    differs from it by."""
    errors = {
        name: max(largest_difference(run[name], value) for _, run in float32_runs)
        for name, value in exact.items()
    }
    loss_error = max(abs(loss - exact_loss) for loss, _ in float32_runs)
    return ExactRun(exact_loss, dict(exact), loss_error, errors)


def largest_difference(tensor: torch.Tensor, exact: torch.Tensor) -> float:
    """max |tensor - exact| over the elements, in float64 (0 for an empty tensor)."""
    if exact.numel() == 0:
        return 0.0
    return float((tensor.double() - exact.double()).abs().max())


def largest_magnitude(tensor: torch.Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


def to_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with float64 parameters, computing in float64: megatron casts activations to
    its config's ``params_dtype`` (Mamba layers) and ``pipeline_dtype``."""
    model.to(torch.float64)
    model.config.params_dtype = torch.float64
    model.config.pipeline_dtype = torch.float64
    return model
