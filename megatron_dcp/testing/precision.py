"""The float32 rounding error of an oracle run, measured: the same single-process run in float64
(exact, to float32's eyes) and in float32 in two sample orders (``ExactRun``, shared with
``megatron-dcp check``'s reference arm: ``tools.check.rounding``). How far a correct distributed
float32 run may stray from the exact values is then a multiple of what float32 rounding did to
the oracle itself (``testing.oracle``), on whatever CPU runs the test. The mixed-precision
oracle (``gpt.mixed_precision_reference``) measures bf16's or fp16's rounding the same way, and
:class:`RanPrecision` records what precision a distributed run really computed in."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

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
    "FP16_EPS",
    "FP16_LOSS_SCALE",
    "HALF_DTYPES",
    "ExactRun",
    "RanPrecision",
    "exact_run",
    "largest_difference",
    "largest_magnitude",
    "loss_scale_of",
    "ran_precision",
    "to_dtype",
    "to_float64",
]

BF16_EPS = torch.finfo(torch.bfloat16).eps  # the ulp of bf16 at 1: 2**-7
FP16_EPS = torch.finfo(torch.float16).eps  # the ulp of fp16 at 1: 2**-10
# The half precisions of megatron's mixed precision (``TinyGPTOptions.half_precision``).
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The fp16 runs' loss scale: megatron's dynamic scaler starts there (``initial_loss_scale``) and
# the oracle's fp16 emulation scales by it. megatron's default start, 2**32, overflows this tiny
# model's fp16 weight gradients (every step would be skipped); ``megatron-dcp check`` starts at
# 2**7 too. The scaler grows it only after ``loss_scale_window`` (1000) clean steps.
FP16_LOSS_SCALE = 2.0**7


def loss_scale_of(dtype: torch.dtype) -> float:
    """What megatron's recipe multiplies the loss by before backward in ``dtype``: the loss scale
    in fp16 (whose range is narrow), 1 otherwise (bf16 has float32's range: no scaler)."""
    return FP16_LOSS_SCALE if dtype == torch.float16 else 1.0


def to_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with float64 parameters, computing in float64."""
    return to_dtype(model, torch.float64)


@dataclasses.dataclass(frozen=True)
class RanPrecision:
    """What a training step computed in, read from megatron's own objects after the run, so
    that a bf16 test proves it ran bf16 mixed precision: the wrappers around the first model
    chunk (outermost first, e.g. DistributedDataParallel, Float16Module, GPTModel), the dtypes of
    the parameters and of their ``main_grad``, and the optimizer's classes with the dtypes of the
    parameters they update (the main copies) and their loss scalers after the run (class name and
    scale, None for none; all empty without an optimizer)."""

    wrappers: tuple[str, ...]
    param_dtypes: frozenset
    main_grad_dtypes: frozenset
    optimizers: frozenset = frozenset()
    main_param_dtypes: frozenset = frozenset()
    grad_scalers: frozenset = frozenset()


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
        frozenset(_grad_scaler(each) for each in inner),
    )


def _grad_scaler(optimizer: Any) -> Optional[tuple[str, float]]:
    """The class and current scale of a megatron optimizer's loss scaler (None without one)."""
    scaler = getattr(optimizer, "grad_scaler", None)
    return None if scaler is None else (type(scaler).__name__, float(scaler.scale))
