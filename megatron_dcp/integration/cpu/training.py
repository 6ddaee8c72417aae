"""CPU stand-ins for ``megatron.training``: the gradient clip and the start-up notice.

The patch table (``integration/patches/cpu.py``, group ``cpu_training``) installs these and the
other corrections megatron.training needs without CUDA; docs/cpu_backend.md explains each.
"""

from __future__ import annotations

from typing import Any

import torch


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
    return (
        "megatron_dcp: no CUDA device, using the CPU backend (gloo, fp32, reference THD/CP "
        "attention); see docs/cpu_backend.md"
    )
