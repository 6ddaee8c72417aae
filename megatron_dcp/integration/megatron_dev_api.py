"""megatron-core dev's dynamic-CP API on megatron-core 0.19.x, backed by megatron_dcp.

RL engines written against megatron-core's development branch (verl 0.9's Megatron engine)
call a handful of names that no released megatron-core has. ``install_upstream_api`` (a switch of
the patch table, ``integration.patches``) makes them exist, each through the patch table (group
``upstream``) and only where the installed megatron-core lacks it:

- ``megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler``:
  :class:`DefaultDynamicCPScheduler`, megatron_dcp's ``default_dynamic_cp`` planner behind dev's
  constructor (every argument honoured, an unknown one a ``TypeError``) and
  ``get_groups_and_subsamples``;
- ``parallel_state.initialize_model_parallel(..., dynamic_context_parallel=True)``: megatron's
  own initialisation, then the DCP groups of the runtime (:class:`DCPGroups`, created once) and
  a one-rank group per rank;
- ``parallel_state.get_dynamic_data_context_parallel_groups(group_size=k)``: this rank's group
  of ``k`` ranks (``k = 1``: its one-rank group, which a replicated batch uses as its data-parallel
  group); ``parallel_state.destroy_model_parallel`` destroys them too;
- the ``dynamic_context_parallel`` config field (``TransformerConfig`` and its subclasses);
- megatron's schedules, given verl's DCP micro-batches of a model with MTP, weigh the MTP loss
  by the global batch's token ratios (:func:`replicated_batch_mtp_masks`, then
  ``patches.mtp_loss``), as megatron_dcp's own paths do.

The same call applies the ``dcp`` group of the table, which makes attention, RoPE, MTP and Mamba
run each micro-batch on ``PackedSeqParams.cp_group``.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dcp.runtime.groups import DCPGroups
from megatron_dcp.scheduling import Plan, Scheduler, build_scheduler
from megatron_dcp.scheduling.domain import (
    is_power_of_two,
    largest_power_of_two_at_most,
)
from megatron_dcp.scheduling.errors import SchedulingError

SCHEDULER = "default_dynamic_cp"
WHOLE_DOMAIN_SCHEDULER = "dp_balanced"
INSTALL = "megatron_dcp.install_upstream_api()"
# The commit of Megatron-LM's dev branch whose constructor the stand-in keeps (the peer's too:
# tools/peers/megatron_dev_greedy.py).
DEV_COMMIT = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
# How megatron-core dev (and verl's engine config) name the scheduling parameters.
UPSTREAM_WORDING = {
    "budget": "max_seqlen_per_dp_cp_rank",
    "vpp": "microbatch_group_size_per_vp_stage",
    "max_seqlen": "shorter sequences (cap the rollout length)",
    "max_samples": "max_num_seqs",
}
# How often the stand-in plans again with padded lengths before it pads every sequence for
# every CP size at once (the least common multiple of the sizes).
PAD_ROUNDS = 8


def padded_length(length: int, cp_size: int) -> int:
    """``length`` padded to a multiple of 2 × ``cp_size`` (the zigzag layout's chunks)."""
    multiple = 2 * cp_size
    return -(-length // multiple) * multiple


def group_size_of_each_sample(plan: Plan) -> List[int]:
    """The CP size of the group each sample of ``plan`` is in, by sample id."""
    sizes = [0] * len(plan.seqlens)
    for microbatch in plan.microbatches:
        for group in microbatch.groups:
            for sample in group.sample_ids:
                sizes[sample] = group.size
    return sizes


class DefaultDynamicCPScheduler:
    """megatron-core dev's scheduler interface, planned by ``default_dynamic_cp`` over a DP×CP
    domain of ``dp_size × cp_size`` ranks with ``max_seqlen_per_dp_cp_rank`` tokens per rank.

    The constructor is dev's (``DefaultDynamicCPScheduler`` and its base ``DpBalancedScheduler``
    at ``DEV_COMMIT``), every argument honoured:

    - ``microbatch_group_size_per_vp_stage``: with VPP (> 1) the micro-batch count is a
      multiple of it;
    - ``max_num_seqs``: at most that many sequences in one rank's pack (one CP group);
    - ``min_cp_size``: no group of fewer ranks; a power of two, or the whole domain (the sizes
      dev creates dynamic groups of); any other value is a ``ValueError`` naming it;
    - ``pad_sequences`` (not an argument of dev's at ``DEV_COMMIT``; accepted for callers that
      pad): a group's capacity counts each sequence padded to a multiple of 2 × its CP size.

    Any other argument is a ``TypeError``, as it is for dev's class. ``cp_group_sizes``: the CP
    sizes this scheduler's groups may take, ascending: the powers of two from ``min_cp_size`` up
    to the domain and the whole domain (the dynamic groups of those sizes exist)."""

    def __init__(
        self,
        max_seqlen_per_dp_cp_rank: int,
        cp_size: int,
        dp_size: int,
        microbatch_group_size_per_vp_stage: Optional[int] = None,
        max_num_seqs: Optional[int] = None,
        *,
        min_cp_size: int = 1,
        pad_sequences: bool = False,
    ) -> None:
        self.max_seqlen_per_dp_cp_rank = self.max_seq_len_per_rank = max_seqlen_per_dp_cp_rank
        self.cp_size, self.dp_size = cp_size, dp_size
        self.microbatch_group_size_per_vp_stage = microbatch_group_size_per_vp_stage
        self.max_num_seqs, self.min_cp_size = max_num_seqs, min_cp_size
        self.pad_sequences = bool(pad_sequences)
        self.is_dynamic_cp = True
        self.scheduler = _planner(self)
        domain = self.scheduler.domain
        self.domain_size = self.total_hdp_gpus = domain.size
        self.max_seq_len_all_ranks = max_seqlen_per_dp_cp_rank * cp_size
        whole = self.scheduler.name == WHOLE_DOMAIN_SCHEDULER
        self.cp_group_sizes: Tuple[int, ...] = (domain.size,) if whole else domain.group_sizes

    def get_groups_and_subsamples(self, samples: Sequence[Tuple[Any, int]]) -> List[List[list]]:
        """``samples`` is ``[(sample_id, length), ...]``. Returns the micro-batches; each lists,
        for every rank of the domain in order, the ids of the samples that rank processes (the
        ranks of one CP group hold the same list; no rank's list is empty)."""
        if not samples:
            raise ValueError("get_groups_and_subsamples: no samples to schedule")
        ids = [sample_id for sample_id, _ in samples]
        lengths = [length for _, length in samples]
        try:
            plan = self.scheduler.schedule(lengths)
            if self.pad_sequences:
                plan = self._padded_plan(lengths, plan)
        except SchedulingError as error:
            raise ValueError(error.worded(UPSTREAM_WORDING)) from None
        return rank_assignments(plan, ids, self.domain_size)

    def _padded_plan(self, lengths: Sequence[int], plan: Plan) -> Plan:
        """A plan whose every group holds its sequences padded to 2 × its CP size: planned
        again with each length raised to its padding in the group it took, until no sequence
        needs more (padding only grows), else with every length padded for every size."""
        planned = list(lengths)
        for _ in range(PAD_ROUNDS):
            sizes = group_size_of_each_sample(plan)
            needed = [padded_length(n, size) for n, size in zip(lengths, sizes)]
            if all(need <= have for need, have in zip(needed, planned)):
                return plan
            planned = [max(need, have) for need, have in zip(needed, planned)]
            plan = self.scheduler.schedule(planned)
        widest = math.lcm(*self.cp_group_sizes)
        return self.scheduler.schedule([padded_length(n, widest) for n in lengths])


def _planner(scheduler: DefaultDynamicCPScheduler) -> Scheduler:
    """megatron_dcp's planner for the stand-in's settings: ``default_dynamic_cp``, or, where
    ``min_cp_size`` is the whole domain and no power of two, one group over the whole domain."""
    size, min_cp = scheduler.dp_size * scheduler.cp_size, scheduler.min_cp_size
    settings = dict(
        dp_size=scheduler.dp_size,
        cp_size=scheduler.cp_size,
        max_seqlen_per_dp_cp_rank=scheduler.max_seqlen_per_dp_cp_rank,
        min_cp_size=min_cp,
        microbatch_group_size_per_vp_stage=scheduler.microbatch_group_size_per_vp_stage,
        max_samples_per_group=scheduler.max_num_seqs,
    )
    name = SCHEDULER
    if isinstance(min_cp, int) and isinstance(size, int) and size > 0:
        if min_cp == size and not is_power_of_two(size):
            name = WHOLE_DOMAIN_SCHEDULER
            settings.update(dp_size=1, cp_size=size, min_cp_size=1)
        elif not (is_power_of_two(min_cp) and min_cp <= size):
            sizes = [1 << k for k in range(largest_power_of_two_at_most(size).bit_length())]
            sizes += [] if is_power_of_two(size) else [size]
            choices = ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}" if sizes[1:] else "1"
            raise ValueError(
                f"min_cp_size={min_cp!r}: megatron-core dev creates dynamic CP groups of the "
                f"powers of two from min_cp_size up and of the whole DP×CP domain ({size} ranks); "
                f"use {choices}"
            )
    try:
        return build_scheduler(name, **settings)
    except SchedulingError as error:
        raise ValueError(error.worded(UPSTREAM_WORDING)) from None


def rank_assignments(plan: Plan, ids: Sequence[Any], domain_size: int) -> List[List[list]]:
    """The plan as dev's nested lists: per micro-batch, per position, the sample ids."""
    microbatches = []
    for microbatch in plan.microbatches:
        ranks: List[list] = [[] for _ in range(domain_size)]
        for group in microbatch.groups:
            members = [ids[sample] for sample in group.sample_ids]
            for position in group.ranks:
                ranks[position] = list(members)
        microbatches.append(ranks)
    return microbatches


class _DynamicGroups:
    """The groups ``initialize_model_parallel(dynamic_context_parallel=True)`` created."""

    registry: Optional[DCPGroups] = None
    solo: Optional[Any] = None


_GROUPS = _DynamicGroups()


def create_dynamic_groups() -> None:
    """The DCP groups of the runtime over megatron's DP×CP domain, and a one-rank group for
    this rank (after megatron's own initialisation; collective over the world)."""
    from megatron_dcp.integration.process_groups import create_dcp_groups

    if _GROUPS.registry is not None:
        return
    _GROUPS.registry = create_dcp_groups(min_cp_size=1)
    _GROUPS.solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)


def destroy_dynamic_groups() -> None:
    """Destroy what :func:`create_dynamic_groups` created. Idempotent."""
    if _GROUPS.registry is not None:
        _GROUPS.registry.destroy()
    if _GROUPS.solo is not None:
        dist.destroy_process_group(_GROUPS.solo)
    _GROUPS.registry = _GROUPS.solo = None


def dynamic_groups_created() -> bool:
    return _GROUPS.registry is not None


def dynamic_group(group_size: Optional[int], check_initialized: bool = True) -> Optional[Any]:
    """This rank's group of ``group_size`` ranks of its DP×CP domain (dev's
    ``get_dynamic_data_context_parallel_groups``)."""
    registry = _GROUPS.registry
    if registry is None:
        if not check_initialized:
            return None
        raise AssertionError(
            "dynamic DP×CP groups are not initialised: call "
            f"{INSTALL} before parallel_state.initialize_model_parallel(..., "
            "dynamic_context_parallel=True)"
        )
    if group_size == 1:
        return _GROUPS.solo
    if group_size not in registry.sizes:
        sizes = ", ".join(map(str, registry.sizes))
        raise KeyError(f"group_size={group_size!r}: the dynamic DP×CP group sizes are {sizes}")
    return registry.group(group_size)


# verl's names for a DCP micro-batch's scheduling data (verl.utils.dynamic_cp_scheduler).
VERL_LOCAL_CP_SIZE = "local_cp_size"
VERL_GROUP_LEADER = "_dcp_group_leader"


def _non_tensor(micro_batch: Any, key: str, default: Any) -> Any:
    """A TensorDict's non-tensor entry, unwrapped (``NonTensorData`` keeps it in ``.data``)."""
    value = micro_batch.get(key, default)
    return getattr(value, "data", value)


def is_replicated_dcp_micro_batch(micro_batch: Any) -> bool:
    """Whether ``micro_batch`` is one of verl's DCP micro-batches (a TensorDict cut from the
    replicated batch by ``DynamicCPScheduler.schedule``, with nested ``input_ids`` and
    ``loss_mask``)."""
    keys = getattr(micro_batch, "keys", None)
    if keys is None or _non_tensor(micro_batch, VERL_LOCAL_CP_SIZE, None) is None:
        return False
    names = set(keys())
    return {"input_ids", "loss_mask", VERL_GROUP_LEADER} <= names


def replicated_batch_mtp_masks(micro_batches: Sequence[Any]) -> Optional[List[Any]]:
    """The MTP loss masks of the samples this rank's CP groups own (it leads the group), one per
    sample, over all of verl's DCP micro-batches of one global batch; None when they are not
    all verl's. Summed over the DP×CP domain they count every sample of the batch once.

    verl's MTP forward (``gptmodel_forward_model_engine``) gives the model the loss mask with
    prompt zeros in front (when it covers the response only), rolled one place left with the
    labels (``input_ids`` rolled): the mask of token t is that of token t+1, and the sequence's
    last position wraps to its first entry, which is a prompt token's (0)."""
    if not micro_batches or not all(map(is_replicated_dcp_micro_batch, micro_batches)):
        return None
    masks = []
    for micro_batch in micro_batches:
        if not _non_tensor(micro_batch, VERL_GROUP_LEADER, False):
            continue
        lengths = micro_batch["input_ids"].offsets().diff().tolist()
        for length, mask in zip(lengths, micro_batch["loss_mask"].unbind()):
            full = mask.reshape(-1).double()
            full = torch.cat([full.new_zeros(length - full.numel()), full])
            masks.append(torch.cat([full[1:], full[:1]]))
    return masks
