"""The process groups DCP creates on an initialised megatron: the DCP groups over its DP×CP
domains (:func:`create_dcp_groups`), and the TP × CP groups of the MoE router under tensor
parallelism (docs/runtime.md, MoE).

megatron's router reduces its statistics over TP × CP. For a DCP micro-batch that is TP × the
micro-batch's CP group: the ranks of its CP block, each with its whole TP group. Under megatron's
default rank order (TP fastest, then CP, then DP) the global rank of DP×CP position p and TP rank
t is ``base + tp · p + t``, so the TP×DP×CP ranks sorted put position p's TP group at
``[tp · p, tp · (p + 1))`` and a CP block [s, s + c) becomes the aligned block
[tp · s, tp · (s + c)) of size tp · c. One more :class:`DCPGroups` over megatron's TP×DP×CP rank
lists, with smallest size tp · min_cp_size, therefore holds every TP × CP group a plan may use;
:func:`create_tp_cp_groups` builds it once at start-up (collective over the world) and checks the
layout against megatron's own groups.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from megatron_dcp.runtime.groups import DCPGroups, domain_rank_lists_from
from megatron_dcp.scheduling import CPGroup


def create_dcp_groups(min_cp_size: int = 1) -> DCPGroups:
    """DCP groups over megatron's DP×CP domains (call after ``initialize_model_parallel``, on
    every rank, in the same order). The DP×CP group and the static CP groups are reused."""
    from megatron.core import parallel_state

    domain = parallel_state.get_data_parallel_group(with_context_parallel=True)
    reuse = {}
    for group in (domain, parallel_state.get_context_parallel_group()):
        reuse[tuple(dist.get_process_group_ranks(group))] = group
    return DCPGroups.create(domain_rank_lists_from(domain), min_cp_size, reuse=reuse)


def needs_tp_cp_groups(model_config: Any) -> bool:
    """MoE layers with TP > 1: the router needs TP × (micro-batch CP group)."""
    moe = bool(getattr(model_config, "num_moe_experts", None))
    return moe and getattr(model_config, "tensor_model_parallel_size", 1) > 1


def create_tp_cp_groups(groups: DCPGroups) -> DCPGroups:
    """The TP × CP groups of every CP group of ``groups`` (the DP×CP registry): a DCPGroups over
    megatron's TP×DP×CP domains, reusing megatron's TP, static TP×CP and TP×DP×CP groups.
    Call after ``initialize_model_parallel``, on every rank, in the same order."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp & (tp - 1):
        raise ValueError(
            f"DCP with MoE needs a power-of-two --tensor-model-parallel-size (got {tp}): the "
            "router's TP x CP groups are the aligned blocks of TP x (a power-of-two CP size)."
        )
    domain = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    reuse = {}
    for group in (
        domain,
        parallel_state.get_tensor_and_context_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
    ):
        reuse[tuple(sorted(dist.get_process_group_ranks(group)))] = group
    min_size = tp * min(groups.sizes)
    tp_cp = DCPGroups.create(domain_rank_lists_from(domain), min_size, reuse=reuse)
    check_layout(groups, tp_cp, tp)
    return tp_cp


def check_layout(groups: DCPGroups, tp_cp: DCPGroups, tp: int) -> None:
    """The rank order this relies on (module docstring), checked on this rank: its DP×CP domain
    interleaved with its TP rank, its TP group, and megatron's static TP×CP group."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_ranks = tuple(
        sorted(dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()))
    )
    static = parallel_state.get_tensor_and_context_parallel_group()
    static_ranks = tuple(sorted(dist.get_process_group_ranks(static)))
    problems = []
    same_size = tp_cp.domain_size == tp * groups.domain_size
    interleaved = same_size and tuple(
        tp_cp.domain_ranks[tp * p + tp_rank] for p in range(groups.domain_size)
    )
    if interleaved != groups.domain_ranks:
        problems.append(
            f"DP×CP domain {list(groups.domain_ranks)} is not TP rank {tp_rank} of "
            f"TP×DP×CP domain {list(tp_cp.domain_ranks)}"
        )
    if tp in tp_cp.sizes and tp_cp.ranks(tp) != tp_ranks:
        problems.append(f"TP group {list(tp_ranks)} != block {list(tp_cp.ranks(tp))}")
    cp = len(static_ranks) // tp
    if cp in groups.sizes and tp_cp.ranks(tp * cp) != static_ranks:
        problems.append(f"static TP×CP group {list(static_ranks)} != {list(tp_cp.ranks(tp * cp))}")
    if problems:
        raise RuntimeError(
            "DCP with MoE and TP > 1 needs megatron's default rank order (TP fastest, then CP, "
            "then DP): " + "; ".join(problems)
        )


def tp_cp_group_for(tp_cp: DCPGroups, groups: DCPGroups, cp_group: CPGroup) -> Optional[Any]:
    """This rank's TP × CP group for a plan's CP group (the TP group for a group of 1)."""
    groups.group_for(cp_group)  # validates the block
    tp = tp_cp.domain_size // groups.domain_size
    return tp_cp.group(tp * len(cp_group.ranks))
