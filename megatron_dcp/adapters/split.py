"""Split a mini-batch that every rank holds into this rank's DCP micro-batches.

RL engines (verl-style) hand every rank of the DP×CP domain the same mini-batch of rollouts. The
plan is a pure function of the lengths, so every rank computes the same plan locally and keeps
the samples of the CP groups it belongs to: no routing, no length exchange. Each micro-batch may
run on a different CP size (the pretraining scheduler picks a CP degree per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch.distributed import ProcessGroup

from megatron_dcp.integration.config import DCPConfig, plan_with
from megatron_dcp.integration.forward_backward import (
    Batch,
    as_sample,
    batch_of,
    pack_group,
    packed_seq_params_of,
)
from megatron_dcp.integration.patches.mtp_loss import (
    MTP_RATIOS_ATTRIBUTE,
    loss_token_counts,
    token_ratios,
)
from megatron_dcp.runtime.groups import DCPGroups
from megatron_dcp.runtime.pack_padding import NO_PADDING
from megatron_dcp.runtime.packing import PackedMicroBatch, zigzag_slice
from megatron_dcp.scheduling import CPGroup, Plan

Sample = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RankMicroBatch:
    """This rank's share of one micro-batch of the plan.

    ``sample_ids`` are the group's samples in packing order (every rank of the group packs the
    same ones); ``cp_rank`` is this rank's index in its CP group of ``local_cp_size`` ranks;
    ``cp_group`` is None when ``local_cp_size`` is 1 (no CP communication).
    """

    index: int
    sample_ids: tuple[int, ...]
    local_cp_size: int
    cp_rank: int
    cp_group: Optional[ProcessGroup]
    packed: PackedMicroBatch
    packed_seq_params: Any

    def as_batch(self) -> Batch:
        """The dict ``integration.training.forward_step.forward_step`` takes, for megatron's schedules."""
        return dict(batch_of(self.packed, self.cp_group), packed_seq_params=self.packed_seq_params)


@dataclass(frozen=True)
class SplitBatch:
    """A mini-batch split for one rank: the plan (the same on every rank), this rank's
    ``position`` in the domain and its micro-batches (one per micro-batch of the plan), and the
    mini-batch's loss-carrying token count, each real token counted once."""

    plan: Plan
    config: DCPConfig
    position: int
    microbatches: tuple[RankMicroBatch, ...]
    num_tokens: int

    @property
    def num_samples(self) -> int:
        return len(self.plan.seqlens)

    @property
    def local_num_tokens(self) -> int:
        """Loss-carrying tokens this rank holds (its zigzag chunks only)."""
        return sum(mb.packed.num_tokens for mb in self.microbatches)


def plan_batch(
    seqlens: Sequence[int],
    domain_size: int,
    config: DCPConfig,
    domain_ranks: Optional[Sequence[int]] = None,
) -> Plan:
    """The plan of a mini-batch with ``seqlens`` over a domain of ``domain_size`` positions; a
    pure function of its inputs, so every rank computes the same plan without communication.
    ``domain_ranks`` (the domain's global ranks, ``groups.domain_ranks``) let the cost model
    price CP groups that span nodes (``config.ranks_per_node``); without them, one link tier."""
    return plan_with(config.build_scheduler(domain_size, domain_ranks), seqlens)


def split_batch(
    samples: Sequence[Mapping[str, Any]],
    groups: DCPGroups,
    config: DCPConfig,
    plan: Optional[Plan] = None,
    mtp_depth: int = 0,
) -> SplitBatch:
    """This rank's micro-batches of a mini-batch that every rank holds in full.

    ``samples``: dicts with 1-D (or ``[1, L]``) ``tokens``, ``labels``, ``loss_mask``; sample id =
    index. ``groups``: the DCP process groups (``integration.process_groups.create_dcp_groups`` in megatron,
    whose domain is the DP×CP group). ``plan``: a plan computed ahead (e.g. for the next
    mini-batch, off the critical path); by default it is computed here. ``mtp_depth``: the
    model's MTP layers; each micro-batch then names the mini-batch's MTP token ratios, so the
    MTP loss is weighted by global token counts (``integration.patches.mtp_loss``).
    """
    if config.pack_padding != NO_PADDING:
        raise ValueError(
            f"DCPConfig.pack_padding={config.pack_padding}: the RL adapter packs without pack "
            "padding (merge_outputs reads the packs' layout); leave pack_padding at its default."
        )
    clean = [as_sample(sample) for sample in samples]
    seqlens = [int(sample["tokens"].numel()) for sample in clean]
    if plan is None:
        plan = plan_batch(seqlens, groups.domain_size, config, groups.domain_ranks)
    _check_plan(plan, seqlens, groups.domain_size)
    microbatches = tuple(
        _rank_microbatch(index, group, clean, groups, config)
        for index, group in enumerate(_groups_of(plan, groups.position))
    )
    if mtp_depth:
        ratios = token_ratios(loss_token_counts([s["loss_mask"] for s in clean], mtp_depth))
        for microbatch in microbatches:
            setattr(microbatch.packed_seq_params, MTP_RATIOS_ATTRIBUTE, ratios)
    return SplitBatch(plan, config, groups.position, microbatches, global_num_tokens(clean))


def global_num_tokens(samples: Sequence[Mapping[str, Any]]) -> int:
    """Loss-carrying tokens (``loss_mask != 0``) of the whole mini-batch, each counted once. Every
    rank holds the mini-batch, so no collective is needed (and none can double-count)."""
    return sum(int((torch.as_tensor(s["loss_mask"]) != 0).sum()) for s in samples)


def shard_per_token(
    values: Sequence[torch.Tensor], split: SplitBatch, index: int, fill: float = 0
) -> torch.Tensor:
    """This rank's share of a per-token quantity of the whole mini-batch (advantages, old
    log-probs, response masks...) for micro-batch ``index``, laid out like its packed tokens.

    ``values[j]`` is sample ``j``'s tensor ``[len_j, *feature]``; the result is
    ``[1, T_local, *feature]`` with padding set to ``fill``: what ``merge_outputs`` inverts.
    """
    _check_values(values, split.plan.seqlens)
    microbatch = split.microbatches[index]
    kept = [values[j] for j in microbatch.sample_ids if split.plan.seqlens[j] > 0]
    return shard_packed(kept, microbatch, values[0], fill)


def shard_packed(
    kept: Sequence[torch.Tensor], microbatch: RankMicroBatch, template: torch.Tensor, fill: float
) -> torch.Tensor:
    """This rank's share of per-token values of ``microbatch``'s own samples: ``kept``, its
    non-empty samples' tensors in packing order, laid out like the packed tokens (``template``
    gives the dtype and per-token shape; padding is ``fill``)."""
    bounds = microbatch.packed.cu_seqlens_padded
    full = template.new_full((int(bounds[-1]), *template.shape[1:]), fill)
    for start, value in zip(bounds.tolist(), kept):
        full[start : start + value.shape[0]] = value
    local = zigzag_slice(full, bounds, microbatch.local_cp_size, microbatch.cp_rank)
    return local.unsqueeze(0)


def _check_values(values: Sequence[torch.Tensor], seqlens: Sequence[int]) -> None:
    """One tensor per sample, each as long as its sample, one per-token shape for all."""
    if len(values) != len(seqlens) or not values:
        raise ValueError(
            f"values has {len(values)} tensors; pass one per sample of the mini-batch "
            f"({len(seqlens)}), in sample-id order"
        )
    for sample_id, (value, length) in enumerate(zip(values, seqlens)):
        if value.dim() < 1 or value.shape[0] != length or value.shape[1:] != values[0].shape[1:]:
            raise ValueError(
                f"values[{sample_id}] has shape {tuple(value.shape)}; expected [{length}, "
                f"*{tuple(values[0].shape[1:])}] (the sample's length, then one per-token shape)"
            )


def _groups_of(plan: Plan, position: int) -> list[CPGroup]:
    """The CP group holding ``position`` in every micro-batch of the plan, in order."""
    return [microbatch.group_of(position) for microbatch in plan.microbatches]


def _rank_microbatch(
    index: int,
    group: CPGroup,
    samples: Sequence[Sample],
    groups: DCPGroups,
    config: DCPConfig,
) -> RankMicroBatch:
    """Pack one micro-batch's group samples and slice this rank's zigzag share."""
    packed, cp_group = pack_group(group, samples, groups, config.pad_multiple(group.size))
    return RankMicroBatch(
        index=index,
        sample_ids=group.sample_ids,
        local_cp_size=group.size,
        cp_rank=packed.cp_rank,
        cp_group=cp_group,
        packed=packed,
        packed_seq_params=packed_seq_params_of(packed, cp_group),
    )


def _check_plan(plan: Plan, seqlens: Sequence[int], domain_size: int) -> None:
    """A plan passed in must be for these lengths and this domain."""
    if tuple(plan.seqlens) != tuple(seqlens):
        raise ValueError(
            f"plan is for {len(plan.seqlens)} samples with lengths {list(plan.seqlens)[:8]}..., "
            f"not for this mini-batch ({len(seqlens)} samples, {list(seqlens)[:8]}...); "
            "plan it with plan_batch(seqlens, ...)"
        )
    if plan.domain.size != domain_size:
        raise ValueError(
            f"plan is for a domain of {plan.domain.size} ranks, the DCP groups span {domain_size}; "
            "plan it with plan_batch(seqlens, groups.domain_size, config, groups.domain_ranks)"
        )
