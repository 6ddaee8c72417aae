"""Set DCP up on an initialised megatron: its process groups and the forward-backward wrapper."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_dcp.integration.schedule import DCPForwardBackward
from megatron_dcp.integration.validation import (
    validate_budget,
    validate_model_config,
    validate_scheduler_name,
)
from megatron_dcp.runtime.groups import DCPGroups, domain_rank_lists_from
from megatron_dcp.scheduling import CostModel, build_scheduler


def create_dcp_groups(min_cp_size: int = 1) -> DCPGroups:
    """DCP groups over megatron's DP×CP domains (call after ``initialize_model_parallel``, on
    every rank, in the same order). The DP×CP group and the static CP groups are reused."""
    from megatron.core import parallel_state

    domain = parallel_state.get_data_parallel_group(with_context_parallel=True)
    reuse = {}
    for group in (domain, parallel_state.get_context_parallel_group()):
        reuse[tuple(dist.get_process_group_ranks(group))] = group
    return DCPGroups.create(domain_rank_lists_from(domain), min_cp_size, reuse=reuse)


def vpp_group_size(config: Any) -> Optional[int]:
    """The number the plan's micro-batch count must be a multiple of under interleaved VPP
    (megatron's ``microbatch_group_size_per_vp_stage``); None without VPP."""
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        return config.microbatch_group_size_per_vp_stage
    return None


def build_forward_backward(
    config: Any,
    max_seqlen_per_dp_cp_rank: int,
    scheduler: str = "default_dynamic_cp",
    min_cp_size: int = 1,
    cost_model: Optional[CostModel] = None,
    groups: Optional[DCPGroups] = None,
    forward_backward_func: Optional[Callable[..., Any]] = None,
) -> DCPForwardBackward:
    """The DCP wrapper around ``get_forward_backward_func()`` for a model with ``config``
    (its TransformerConfig: tp/pp/cp sizes, VPP micro-batch group size, sequence parallel)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    validate_model_config(config)
    validate_budget(
        max_seqlen_per_dp_cp_rank, config.tensor_model_parallel_size, config.sequence_parallel
    )
    return DCPForwardBackward(
        forward_backward_func=forward_backward_func or get_forward_backward_func(),
        scheduler=build_scheduler(
            validate_scheduler_name(scheduler),
            dp_size=parallel_state.get_data_parallel_world_size(),
            cp_size=parallel_state.get_context_parallel_world_size(),
            max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank,
            min_cp_size=min_cp_size,
            microbatch_group_size_per_vp_stage=vpp_group_size(config),
            cost_model=cost_model,
        ),
        groups=groups or create_dcp_groups(min_cp_size),
        dp_group=parallel_state.get_data_parallel_group(),
        domain_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        tp_size=config.tensor_model_parallel_size,
        sequence_parallel=config.sequence_parallel,
    )
