"""Gather per-token outputs of every micro-batch back to every rank, per sample, in order.

After the forward passes each rank holds, per micro-batch, its zigzag share of its CP group's
packed sequences (chunks ``r`` and ``2c-1-r`` of each). The shares of all ranks of the domain
partition the tokens: every token's output lives on exactly one rank, so one all-gather over the
domain of each rank's outputs (one flat buffer) brings every token to every rank exactly once.
Each rank then reassembles every CP group's packed tensor with ``unzigzag`` and cuts it into
samples. All sizes follow from the plan, so no size exchange and no pickling is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_dcp.adapters.split import SplitBatch
from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.runtime.groups import DCPGroups
from megatron_dcp.runtime.packing import padded_length, unzigzag
from megatron_dcp.scheduling import CPGroup, Plan


@dataclass(frozen=True)
class GroupPacking:
    """How a CP group packs its samples: the non-empty samples in packing order, their real
    lengths and the padded cumulative offsets (``cu_seqlens_padded`` of ``pack_samples``)."""

    size: int
    sample_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]

    @property
    def local_tokens(self) -> int:
        """Tokens (real and padding) each rank of the group holds."""
        return self.cu_seqlens_padded[-1] // self.size


def group_packing(plan: Plan, group: CPGroup, config: DCPConfig) -> GroupPacking:
    """The packing layout of ``group``, as ``pack_samples`` builds it: zero-length samples are
    dropped, and a group without tokens packs one all-padding sequence."""
    multiple = config.pad_multiple(group.size)
    kept = tuple(i for i in group.sample_ids if plan.seqlens[i] > 0)
    padded = [padded_length(plan.seqlens[i], multiple) for i in kept] or [multiple]
    offsets = [0]
    for length in padded:
        offsets.append(offsets[-1] + length)
    lengths = tuple(plan.seqlens[i] for i in kept)
    return GroupPacking(group.size, kept, lengths, tuple(offsets))


def local_token_counts(plan: Plan, config: DCPConfig) -> list[list[int]]:
    """Tokens each position holds in each micro-batch: ``counts[position][microbatch]``."""
    counts: list[list[int]] = [[] for _ in range(plan.domain.size)]
    for microbatch in plan.microbatches:
        for group in microbatch.groups:
            tokens = group_packing(plan, group, config).local_tokens
            for position in group.ranks:
                counts[position].append(tokens)
    return counts


def merge_outputs(
    outputs: Sequence[torch.Tensor], split: SplitBatch, groups: DCPGroups
) -> list[torch.Tensor]:
    """Per-sample outputs of the whole mini-batch on every rank, in sample-id order.

    ``outputs[i]`` is this rank's output for ``split.microbatches[i]``, shaped like the model's
    THD output ``[1, T_local, *feature]`` (e.g. per-token log-probs ``[1, T_local]``, or
    ``[1, T_local, k]``); dtype and ``feature`` must be the same on every rank. Sample ``j``
    comes back as ``[len_j, *feature]`` (padding removed), detached. Collective over the domain.
    """
    feature = _check_outputs(outputs, split)
    if split.plan.num_microbatches == 0:
        return []
    local = torch.cat([out.detach().reshape(-1) for out in outputs])
    counts = local_token_counts(split.plan, split.config)
    sizes = [sum(count) * math.prod(feature) for count in counts]
    assert local.numel() == sizes[split.position], "packing and group_packing disagree"
    flat = _all_gather_flat(local, sizes, groups)
    parts = [part.view(-1, *feature) for part in flat]
    return reassemble(split.plan, split.config, parts, feature)


def reassemble(
    plan: Plan, config: DCPConfig, parts: Sequence[torch.Tensor], feature: tuple[int, ...]
) -> list[torch.Tensor]:
    """Per-sample tensors from every position's outputs (``parts[p]``: position ``p``'s
    micro-batch outputs concatenated, ``[T_p, *feature]``). Pure: no communication."""
    counts = local_token_counts(plan, config)
    pieces = [list(torch.split(part, count)) for part, count in zip(parts, counts)]
    template = parts[0]
    merged = [template.new_zeros((0, *feature)) for _ in plan.seqlens]
    for index, microbatch in enumerate(plan.microbatches):
        for group in microbatch.groups:
            layout = group_packing(plan, group, config)
            shares = [pieces[position][index] for position in group.ranks]
            _cut_samples(layout, shares, merged)
    return merged


def _cut_samples(
    layout: GroupPacking, shares: Sequence[torch.Tensor], merged: list[torch.Tensor]
) -> None:
    """Unzigzag one group's shares and store each sample's real tokens in ``merged``."""
    cu_padded = torch.tensor(layout.cu_seqlens_padded, dtype=torch.int64)
    full = unzigzag(shares, cu_padded) if layout.size > 1 else shares[0]
    for sample_id, start, length in zip(
        layout.sample_ids, layout.cu_seqlens_padded, layout.lengths
    ):
        merged[sample_id] = full[start : start + length]


def _all_gather_flat(
    local: torch.Tensor, sizes: Sequence[int], groups: DCPGroups
) -> list[torch.Tensor]:
    """Every position's flat buffer (``sizes[p]`` elements), padded to the largest for gloo's
    equal-size all-gather, then trimmed."""
    if groups.domain_size == 1:
        return [local]
    width = max(sizes)
    padded = torch.cat([local, local.new_zeros(width - local.numel())])
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=groups.group(groups.domain_size))
    return [buffer[:size] for buffer, size in zip(gathered, sizes)]


def _check_outputs(outputs: Sequence[torch.Tensor], split: SplitBatch) -> tuple[int, ...]:
    """Outputs must be ``[1, T_local, *feature]`` per micro-batch, one feature shape for all."""
    if len(outputs) != len(split.microbatches):
        raise ValueError(
            f"outputs has {len(outputs)} tensors; pass one per micro-batch of the split "
            f"({len(split.microbatches)}), in order"
        )
    features = set()
    for index, (out, microbatch) in enumerate(zip(outputs, split.microbatches)):
        expected = microbatch.packed.num_local_tokens
        if out.dim() < 2 or out.shape[0] != 1 or out.shape[1] != expected:
            raise ValueError(
                f"outputs[{index}] has shape {tuple(out.shape)}; expected [1, {expected}, ...] "
                f"(the THD layout of split.microbatches[{index}].packed.tokens)"
            )
        features.add(tuple(out.shape[2:]))
    if len(features) > 1:
        raise ValueError(f"outputs differ in per-token shape {sorted(features)}; use one shape")
    return features.pop() if features else ()
