"""CPU stand-ins for megatron's sequence parallelism, distributed optimizer and gradient clip.

Both features need reduce-scatter and all-gather into one tensor; gloo provides them natively in
the pinned torch (2.13), so no collective is replaced. What stops them on CPU is elsewhere:

* ``sequence_parallel_norm``: megatron's torch norm (``WrappedTorchNorm``, the local layer
  norm without apex) asserts ``not config.sequence_parallel``. Under sequence parallelism each
  tensor-parallel rank normalises its own share of the tokens, so the weight and bias gradients
  are partial sums; megatron's ``finalize_model_grads`` all-reduces exactly the parameters marked
  ``sequence_parallel`` over TP (apex's and Transformer Engine's norms set that mark). The
  stand-in builds the same torch norm and marks its parameters: per-token forward math is
  unchanged, and the gradient sum is megatron's own.
* ``cuda_type_names``: ``DistributedOptimizer.__init__`` sorts parameters by
  ``param.type()`` and accepts only ``torch.cuda.{Float,Half,BFloat16}Tensor``; a CPU fp32
  parameter (``torch.FloatTensor``) is a ``TypeError``. While the constructor runs, ``type()``
  of a CPU tensor answers its CUDA name, so CPU parameters take the path of their dtype.

* ``clip_grad_by_total_norm_cpu``: megatron.training's gradient clip scales the gradients with a
  CUDA multi-tensor kernel; the stand-in applies the same factor tensor by tensor.

The patch table (``integration/patches/cpu_backend.py``, groups ``cpu_backend`` and
``cpu_training``) installs them, only without CUDA; docs/cpu_backend.md explains them.
``cpu_notice`` is the line a CPU training run starts with.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode


def sequence_parallel_norm(original_new: Callable) -> Callable:
    """``WrappedTorchNorm.__new__`` that accepts ``config.sequence_parallel``: the norm is built
    with the flag off (megatron's assertion) and its parameters are marked for the TP gradient
    all-reduce when the flag is on. The config object is restored even on error."""

    def __new__(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        sequence_parallel = bool(config.sequence_parallel)
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    return __new__


class CudaTypeNames(TorchFunctionMode):
    """``tensor.type()`` (no argument) of a CPU tensor answers ``torch.cuda.<Name>Tensor``; every
    other call, ``tensor.type(dtype)`` included, is unchanged."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = args[0].type()  # the mode is off inside its own handler
            if args[0].device.type == "cpu":
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return func(*args, **kwargs)


def cuda_type_names(original_init: Callable) -> Callable:
    """An optimizer constructor (``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params``)
    run under :class:`CudaTypeNames`."""

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        with CudaTypeNames():
            original_init(self, *args, **kwargs)

    return __init__


def clip_grad_by_total_norm_cpu(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))`` (megatron's rule)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    factor = max_norm / (total_norm + 1.0e-6)
    if factor >= 1.0:
        return
    for param in parameters:
        grad = param.decoupled_grad if use_decoupled_grad else param.grad
        if grad is not None:
            grad.detach().mul_(factor)


def cpu_notice() -> str:
    """The start-up line of a training run on the CPU backend."""
    return (
        "megatron_dcp: no CUDA device, using the CPU backend (gloo, fp32 unless --bf16/--fp16, "
        "reference THD/CP attention, megatron's torch fallbacks for Transformer Engine and Apex: "
        "their warnings muted); see docs/cpu_backend.md"
    )
