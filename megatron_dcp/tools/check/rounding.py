"""The rounding error of a reference run, measured: the same run in float64 (exact, to a lower
precision's eyes) and at the run's precision in two sample orders. How far a correct run at that
precision may stray from the exact values is then a multiple of what rounding did to the reference
itself (``tools.check.tolerance``), on whatever machine runs it. Used by ``megatron-dcp check``'s
reference arm and by the oracle tests (``testing.precision``)."""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Sequence

import torch

Tensors = Mapping[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ExactRun:
    """A run in float64 (loss and tensors by global name) with the lower-precision runs' error:
    per tensor the largest element-wise |low - float64| over those runs, and the same for the
    loss."""

    loss_sum: float
    tensors: dict[str, torch.Tensor] = dataclasses.field(repr=False)
    loss_error: float
    errors: dict[str, float] = dataclasses.field(repr=False)


def exact_run(
    exact_loss: float, exact: Tensors, rounded_runs: Sequence[tuple[float, Tensors]]
) -> ExactRun:
    """The float64 run ``(exact_loss, exact)`` and what each lower-precision run
    ``(loss, tensors)`` differs from it by."""
    errors = {
        name: max(largest_difference(run[name], value) for _, run in rounded_runs)
        for name, value in exact.items()
    }
    loss_error = max(abs(loss - exact_loss) for loss, _ in rounded_runs)
    return ExactRun(exact_loss, dict(exact), loss_error, errors)


def add_gradients(
    model: torch.nn.Module,
    sums: Dict[str, torch.Tensor],
    dtype: torch.dtype,
    loss_scale: float = 1.0,
) -> None:
    """Add each parameter's gradient, over ``loss_scale``, to its sum in ``dtype`` (in place)
    and clear it: a reference's emulation of megatron's mixed precision, where DDP adds each
    micro-batch's half-precision gradient to its float32 ``main_grad`` (fp16's loss scale, a
    power of two, divided out exactly). A parameter without a sum gets one at its first
    gradient; one that got no gradient has none."""
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.to(dtype) / loss_scale
            sums[name] = sums[name].add_(grad) if name in sums else grad
            param.grad = None


def largest_difference(tensor: torch.Tensor, exact: torch.Tensor) -> float:
    """max |tensor - exact| over the elements, in float64 (0 for an empty tensor)."""
    if exact.numel() == 0:
        return 0.0
    return float((tensor.double() - exact.double()).abs().max())


def largest_magnitude(tensor: torch.Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with parameters of ``dtype``, computing in it: megatron casts activations to its
    config's ``params_dtype`` (Mamba layers) and ``pipeline_dtype``."""
    model.to(dtype)
    model.config.params_dtype = dtype
    model.config.pipeline_dtype = dtype
    return model
