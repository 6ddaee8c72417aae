"""``megatron.training`` on a machine without CUDA (facts in shared/CPU_BACKEND.md).

On top of :func:`~megatron_dcp.integration.cpu.backend.enable_cpu_backend` (devices, streams and
RNG of megatron.core), the training loop needs these corrections, each naming what it corrects:

- ``typing.override`` (3.12) is imported by ``megatron/training/models``: provided on 3.11;
- ``initialize_megatron`` asserts CUDA: called with its own ``allow_no_cuda=True``, and while it
  runs ``torch.cuda.device_count()`` reports 1 and ``set_device`` does nothing, otherwise the
  model-parallel groups and seeds are silently skipped;
- the dataset helper extension ships prebuilt but ``compile_helpers`` runs ``make`` (no Makefile
  in the wheel) and exits: skipped once the extension is known to import;
- argument validation asks the device architecture for tp/cp > 1: answered 0;
- gradient clipping asserts ``torch.cuda.FloatTensor``: replaced by a CPU clip for fp32 grads;
- the JIT fusion warm-up (``set_jit_fusion_options``) costs seconds per rank and fuses nothing on
  CPU: skipped; and megatron's ``jit_fuser`` (``torch.compile``) would build C++ kernels with
  inductor in every rank at the first step (tens of seconds on two cores for a tiny model):
  torch.compile is disabled, eager mode runs instead;
- ``megatron.training.models.gpt.mtp_block_spec`` builds the MTP layers from megatron's default
  decoder spec, ignoring the layer spec the entry point passes: on CPU their core attention is
  replaced by the reference THD/CP attention as well.

Applied at import time of the entry module (the checkpoint writer's worker processes re-import
it), only when CUDA is absent, idempotently.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import typing
from typing import Any, Callable, Iterator

import torch

from megatron_dcp.integration.cpu.backend import enable_cpu_backend
from megatron_dcp.integration.megatron_import import import_megatron_core

_APPLIED = False


def enable_cpu_training() -> bool:
    """Apply every correction (idempotent); False, and nothing changed, when CUDA is present."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    provide_typing_override()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import_megatron_core()
    enable_cpu_backend()
    for correction in (
        patch_initialize_megatron,
        skip_compile_helpers,
        answer_device_arch,
        patch_grad_clipping,
        skip_jit_fusion_warmup,
        reference_attention_in_mtp,
    ):
        correction()
    _APPLIED = True
    return True


def provide_typing_override() -> None:
    if not hasattr(typing, "override"):
        from typing_extensions import override

        typing.override = override


@contextlib.contextmanager
def one_fake_device() -> Iterator[None]:
    """``device_count() == 1`` and a no-op ``set_device`` for the duration of the block."""
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def patch_initialize_megatron() -> None:
    from megatron.training import initialize, training

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        with one_fake_device():
            return original(*args, **kwargs)

    initialize.initialize_megatron = training.initialize_megatron = initialize_megatron


def skip_compile_helpers() -> None:
    importlib.import_module("megatron.core.datasets.helpers_cpp")  # fails loudly if missing
    from megatron.core.datasets import utils

    utils.compile_helpers = lambda: None


def answer_device_arch() -> None:
    from megatron.core import utils
    from megatron.training import arguments

    utils.get_device_arch_version = arguments.get_device_arch_version = lambda: 0


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


def patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_cpu


def skip_jit_fusion_warmup() -> None:
    from megatron.training import initialize, training

    noop: Callable[..., None] = lambda *args, **kwargs: None  # noqa: E731
    initialize.set_jit_fusion_options = training.set_jit_fusion_options = noop
    torch._dynamo.config.disable = True


def cpu_notice() -> str:
    return (
        "megatron_dcp: no CUDA device, using the CPU backend (gloo, fp32, reference THD/CP "
        "attention); see docs/usage.md"
    )


def reference_attention_in_mtp() -> None:
    from megatron.training.models import gpt

    from megatron_dcp.integration.cpu.attention import with_core_attention

    original = gpt.mtp_block_spec

    @functools.wraps(original)
    def mtp_block_spec(*args: Any, **kwargs: Any) -> Any:
        spec = original(*args, **kwargs)
        return None if spec is None else with_core_attention(spec)

    gpt.mtp_block_spec = mtp_block_spec
