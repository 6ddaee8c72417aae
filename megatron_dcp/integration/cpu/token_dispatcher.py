"""megatron-core's MoE alltoall token dispatcher on CPU tensors (expert parallelism on gloo)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def split_sizes_as_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``moe_utils.maybe_move_tensor_to_cpu`` that also answers numpy for a CPU tensor when asked.

    The alltoall dispatcher moves its all-to-all split sizes "to the CPU, as numpy" through this
    helper, which converts only CUDA tensors: on CPU the sizes stay tensors, and
    ``all_to_all_single`` rejects tensors as split sizes (``TypeError: incompatible function
    arguments``) as soon as expert parallelism is > 1. A copy, as the device-to-host move makes.
    """

    @functools.wraps(original)
    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move
