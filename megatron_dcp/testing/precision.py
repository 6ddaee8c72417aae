"""The float32 rounding error of an oracle run, measured: the same single-process run in float64
(exact, to float32's eyes) and in float32 in two sample orders (``ExactRun``, shared with
``megatron-dcp check``'s reference arm: ``tools.check.rounding``). How far a correct distributed
float32 run may stray from the exact values is then a multiple of what float32 rounding did to
the oracle itself (``testing.oracle``), on whatever CPU runs the test. The bf16 oracle
(``gpt.mixed_precision_reference``) measures bf16 mixed precision's rounding the same way, and
:class:`RanPrecision` records what precision a distributed run really computed in."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from megatron_dcp.tools.check.rounding import (
    ExactRun,
    exact_run,
    largest_difference,
    largest_magnitude,
    to_dtype,
)

__all__ = [
    "BF16_EPS",
    "ExactRun",
    "RanPrecision",
    "exact_run",
    "largest_difference",
    "largest_magnitude",
    "ran_precision",
    "to_dtype",
    "to_float64",
]

BF16_EPS = torch.finfo(torch.bfloat16).eps  # the ulp of bf16 at 1: 2**-7


def to_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with float64 parameters, computing in float64."""
    return to_dtype(model, torch.float64)


@dataclasses.dataclass(frozen=True)
class RanPrecision:
    """What a training step computed in, read from megatron's own objects after the run, so
    that a bf16 test proves it ran bf16 mixed precision: the wrappers around the first model
    chunk (outermost first, e.g. DistributedDataParallel, Float16Module, GPTModel), the dtypes of
    the parameters and of their ``main_grad``, and the optimizer's classes with the dtypes of the
    parameters they update (the main copies; empty without an optimizer)."""

    wrappers: tuple[str, ...]
    param_dtypes: frozenset
    main_grad_dtypes: frozenset
    optimizers: frozenset = frozenset()
    main_param_dtypes: frozenset = frozenset()


def ran_precision(models: Sequence[torch.nn.Module], optimizer: Any = None) -> RanPrecision:
    """The :class:`RanPrecision` of this rank's DDP ``models`` and megatron ``optimizer``."""
    wrappers, model = [], models[0]
    while model is not None:
        wrappers.append(type(model).__name__)
        model = getattr(model, "module", None)
    params = [param for model in models for param in model.parameters()]
    grads = [getattr(param, "main_grad", None) for param in params]
    inner = list(getattr(optimizer, "chained_optimizers", [optimizer])) if optimizer else []
    updated = [
        param
        for each in inner
        for group in each.optimizer.param_groups
        for param in group["params"]
    ]
    return RanPrecision(
        tuple(wrappers),
        frozenset(str(param.dtype) for param in params),
        frozenset(str(grad.dtype) if grad is not None else "none" for grad in grads),
        frozenset(type(each).__name__ for each in inner),
        frozenset(str(param.dtype) for param in updated),
    )
