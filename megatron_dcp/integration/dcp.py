"""Set DCP up on an initialised megatron: its process groups and the forward-backward wrapper."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_dcp.integration.compat import check_model_config
from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.integration.moe_groups import create_tp_cp_groups, needs_tp_cp_groups
from megatron_dcp.integration.nodes import check_ranks_per_node
from megatron_dcp.integration.prefetch import Prefetcher, dedicated_comm
from megatron_dcp.integration.schedule import DCPForwardBackward
from megatron_dcp.runtime.groups import DCPGroups, domain_rank_lists_from


def create_dcp_groups(min_cp_size: int = 1) -> DCPGroups:
    """DCP groups over megatron's DP×CP domains (call after ``initialize_model_parallel``, on
    every rank, in the same order). The DP×CP group and the static CP groups are reused."""
    from megatron.core import parallel_state

    domain = parallel_state.get_data_parallel_group(with_context_parallel=True)
    reuse = {}
    for group in (domain, parallel_state.get_context_parallel_group()):
        reuse[tuple(dist.get_process_group_ranks(group))] = group
    return DCPGroups.create(domain_rank_lists_from(domain), min_cp_size, reuse=reuse)


def build_forward_backward(
    model_config: Any,
    config: DCPConfig,
    groups: Optional[DCPGroups] = None,
    forward_backward_func: Optional[Callable[..., Any]] = None,
) -> DCPForwardBackward:
    """The DCP wrapper around ``get_forward_backward_func()`` for a model with ``model_config``
    (its TransformerConfig), which must agree with ``config`` on the parallel sizes."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    check_model_config(model_config)
    config = config.with_model(model_config)
    domain_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    check_ranks_per_node(config.ranks_per_node, dist.get_world_size())
    groups = groups or create_dcp_groups(config.min_cp_size)
    tp_cp_groups = create_tp_cp_groups(groups) if needs_tp_cp_groups(model_config) else None
    wrapper = DCPForwardBackward(
        forward_backward_func=forward_backward_func or get_forward_backward_func(),
        config=config,
        scheduler=config.build_scheduler(groups.domain_size, groups.domain_ranks),
        groups=groups,
        dp_group=parallel_state.get_data_parallel_group(),
        domain_group=domain_group,
        tp_cp_groups=tp_cp_groups,
        mtp_depth=model_config.mtp_num_layers or 0,
    )
    if config.prefetch:
        wrapper.prefetcher = Prefetcher(wrapper.prepare_from, dedicated_comm(wrapper.comm))
    return wrapper
