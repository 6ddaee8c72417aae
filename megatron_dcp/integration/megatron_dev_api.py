"""megatron-core dev's dynamic-CP API on megatron-core 0.19.x, backed by megatron_dcp.

RL engines written against megatron-core's development branch (verl 0.9's Megatron engine)
call a handful of names that no released megatron-core has. ``install_upstream_api`` (a switch of
the patch table, ``integration.patches``) makes them exist, each through the patch table (group ``upstream``) and only where the installed
megatron-core lacks it:

- ``megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler``:
  :class:`DefaultDynamicCPScheduler`, megatron_dcp's ``default_dynamic_cp`` planner behind dev's
  constructor and ``get_groups_and_subsamples``;
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

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dcp.runtime.groups import DCPGroups
from megatron_dcp.scheduling import Plan, build_scheduler
from megatron_dcp.scheduling.errors import SchedulingError

SCHEDULER = "default_dynamic_cp"
INSTALL = "megatron_dcp.install_upstream_api()"
# How megatron-core dev (and verl's engine config) name the scheduling parameters.
UPSTREAM_WORDING = {
    "budget": "max_seqlen_per_dp_cp_rank",
    "vpp": "microbatch_group_size_per_vp_stage",
    "max_seqlen": "shorter sequences (cap the rollout length)",
}


class DefaultDynamicCPScheduler:
    """megatron-core dev's scheduler interface, planned by ``default_dynamic_cp`` over a DP×CP
    domain of ``dp_size × cp_size`` ranks with ``max_seqlen_per_dp_cp_rank`` tokens per rank."""

    def __init__(
        self,
        max_seqlen_per_dp_cp_rank: int,
        cp_size: int,
        dp_size: int,
        microbatch_group_size_per_vp_stage: Optional[int] = None,
        **_: Any,
    ) -> None:
        try:
            self.scheduler = build_scheduler(
                SCHEDULER,
                dp_size=dp_size,
                cp_size=cp_size,
                max_seqlen_per_dp_cp_rank=max_seqlen_per_dp_cp_rank,
                min_cp_size=1,
                microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
            )
        except SchedulingError as error:
            raise ValueError(error.worded(UPSTREAM_WORDING)) from None
        self.domain_size = dp_size * cp_size

    def get_groups_and_subsamples(self, samples: Sequence[Tuple[Any, int]]) -> List[List[list]]:
        """``samples`` is ``[(sample_id, length), ...]``. Returns the micro-batches; each lists,
        for every rank of the domain in order, the ids of the samples that rank processes (the
        ranks of one CP group hold the same list; no rank's list is empty)."""
        if not samples:
            raise ValueError("get_groups_and_subsamples: no samples to schedule")
        ids = [sample_id for sample_id, _ in samples]
        try:
            plan = self.scheduler.schedule([length for _, length in samples])
        except SchedulingError as error:
            raise ValueError(error.worded(UPSTREAM_WORDING)) from None
        return rank_assignments(plan, ids, self.domain_size)


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
