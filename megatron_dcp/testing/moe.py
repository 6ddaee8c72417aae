"""Expert parallelism in the tiny-GPT fixtures: global expert names and gradient gathering.

Under expert parallelism (EP) every EP rank holds ``num_moe_experts / EP`` experts, each named
``...experts.local_experts.<local index>...``: the same name on every EP rank for different
experts. The fixtures initialise and compare parameters by their name in the single-process model
(``testing.gpt``), so expert names are rewritten to the global expert index, and expert gradients
are summed over the ranks holding the same experts (megatron's expert-data-parallel group, not
DP×CP) and then collected from every EP rank.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dcp.integration.megatron_import import import_megatron_core

import_megatron_core()

from megatron.core import parallel_state  # noqa: E402

_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def global_expert_name(name: str, num_experts: Optional[int]) -> str:
    """``name`` with a local expert index replaced by the global one (EP rank-major)."""
    match = _LOCAL_EXPERT.search(name)
    if match is None or not num_experts:
        return name
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * (num_experts // ep_size)
    index = first + int(match.group(1))
    return f"{name[:match.start()]}.experts.local_experts.{index}.{name[match.end():]}"


def is_expert_parameter(param: torch.Tensor) -> bool:
    """megatron marks the parameters of expert-parallel experts ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def tensor_parallel_group(param: torch.Tensor) -> Any:
    """The group a tensor-parallel ``param`` is split over: expert TP for an expert parameter."""
    if is_expert_parameter(param):
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def gradient_sum_group(param: torch.Tensor) -> Any:
    """The group whose ranks' gradients of ``param`` add up to its full gradient: the ranks that
    hold the same experts for an expert parameter, DP×CP for every other one."""
    if is_expert_parameter(param):
        return parallel_state.get_expert_data_parallel_group()
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def merge_expert_parallel(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every EP rank's tensors, by name (expert names are global, so each appears once; the
    others are equal on every EP rank). Collective over the EP group."""
    group = parallel_state.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return local
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in part.items():
            merged.setdefault(name, tensor)
    return merged


def moe_fields(options: Any) -> dict:
    """TransformerConfig's MoE fields (none for a dense model); EP, ETP from the initialised
    state."""
    if not options.num_moe_experts:
        return {}
    return dict(
        num_moe_experts=options.num_moe_experts,
        moe_router_topk=options.moe_router_topk,
        moe_router_load_balancing_type=listed_or_str(options.moe_router_load_balancing_type),
        moe_aux_loss_coeff=listed_or_str(options.moe_aux_loss_coeff),
        moe_z_loss_coeff=options.moe_z_loss_coeff,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )


def listed_or_str(value):
    """Per-type MoE settings are lists in TransformerConfig, tuples in the hashable options."""
    return list(value) if isinstance(value, tuple) else value
