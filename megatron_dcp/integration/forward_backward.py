"""The DCP forward-backward wrapper around megatron's pipeline schedules, and its construction on an
initialised megatron (:func:`build_forward_backward`).

``DCPForwardBackward(get_forward_backward_func(), ...)`` is called exactly like the function it
wraps. Once per global batch it

1. takes this DP rank's samples of the global batch from the data iterator
   (``num_microbatches × micro_batch_size`` of them: what megatron itself would consume),
2. exchanges the lengths over DP and plans the batch (every rank computes the same plan, which
   the plan-consistency guard checks: ``runtime.plan_guard``),
3. routes the samples so that each rank holds exactly those of its CP groups (an all-to-all over
   DP×CP, or an all-gather inside each CP lane: ``--dcp-routing``),
4. packs each micro-batch of this rank as THD with zigzag CP slicing and a ``PackedSeqParams``
   that names the micro-batch's CP group,
5. runs the real schedule (no pipelining, 1F1B or interleaved VPP) on those micro-batches.

The forward step receives one :data:`Batch` dict per micro-batch from its iterator. Losses must
be per-token sums (``calculate_per_token_loss``): the schedule then divides the gradients by the
global token count, which is right whatever CP group or micro-batch count a rank ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dcp.integration.config import AUTO_ROUTING, DCPConfig, plan_with
from megatron_dcp.integration.model_checks import check_model_config
from megatron_dcp.integration.model_cost import predicted_step_time
from megatron_dcp.integration.node_layout import check_ranks_per_node
from megatron_dcp.integration.patches.cp_switching import TP_CP_GROUP_ATTRIBUTE
from megatron_dcp.integration.patches.mtp_loss import MTP_RATIOS_ATTRIBUTE, mtp_token_ratios
from megatron_dcp.integration.patches.pipeline_shapes import PlannedShapes, planned_shapes
from megatron_dcp.integration.prefetch import Comm, Prefetcher, dedicated_comm
from megatron_dcp.integration.vision_batches import (
    IMAGES,
    VISION_SLOT,
    BatchTiles,
    RoutedImages,
    TileRoute,
    VisionSpec,
    exchange_tiles,
    micro_batch_images,
    offset_slots,
    route_tiles,
    split_images,
    vision_images,
)
from megatron_dcp.integration.process_groups import (
    create_dcp_groups,
    create_tp_cp_groups,
    needs_tp_cp_groups,
    tp_cp_group_for,
)
from megatron_dcp.runtime.exchange import GlobalLengths, collective_device, gather_lengths
from megatron_dcp.runtime.groups import DCPGroups
from megatron_dcp.runtime.pack_padding import NO_PADDING, PackPadding
from megatron_dcp.runtime.packing import PackedMicroBatch, pack_samples, to_device
from megatron_dcp.runtime.plan_guard import check_same_plan
from megatron_dcp.runtime.routing import (
    ALL_TO_ALL,
    LANE_ALL_GATHER,
    RoutedSamples,
    SampleSchema,
    route_by_lane_all_gather,
    route_samples,
)
from megatron_dcp.scheduling import CostModel, CPGroup, Plan
from megatron_dcp.scheduling.metrics import plan_imbalance
from megatron_dcp.scheduling.registry import Scheduler

Sample = Dict[str, torch.Tensor]
Batch = Dict[str, Any]
SAMPLE_DTYPES = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32}
SAMPLE_KEYS = tuple(SAMPLE_DTYPES)
# Every rank's samples carry these fields (``as_sample`` casts them): no collective is needed to
# agree on what is routed.
SAMPLE_SCHEMA = SampleSchema.of(
    {key: torch.empty(0, dtype=dtype) for key, dtype in SAMPLE_DTYPES.items()}
)
# A vision-language sample's per-token fields (its images travel apart: ``vision_batches``).
VLM_SCHEMA = SampleSchema.of(
    {key: torch.empty(0, dtype=dtype) for key, dtype in SAMPLE_DTYPES.items()}
    | {VISION_SLOT: torch.empty(0, dtype=torch.int64)}
)


@dataclass(frozen=True)
class BatchStats:
    """DCP figures of one global batch (for logging and FLOPs accounting)."""

    num_microbatches: int
    cp_size_histogram: Dict[int, int]
    plan_time_s: float
    sum_seqlen: int
    sum_seqlen_squared: int
    local_tokens: int
    bytes_received: int
    # Σ_micro-batch max-rank cost / Σ_micro-batch mean-rank cost, from the scheduler's cost model.
    estimated_imbalance: float
    # Forward-backward seconds of the busiest position under the cost model that planned it.
    predicted_step_s: float = 0.0
    # Image tiles this rank encoded (vision-language models): each tile once per CP group.
    encoder_tiles: int = 0


@dataclass(frozen=True)
class Prepared:
    """One global batch made ready to run: this rank's packed micro-batches, the plan, figures."""

    batches: List[Batch]
    plan: Plan
    stats: BatchStats


@dataclass
class DCPForwardBackward:
    """Wraps a megatron forward-backward function (see the module docstring).

    ``groups`` are the DCP process groups (and this rank's position in the domain); ``dp_group``
    joins the ranks that hold different samples (same CP rank, other DP ranks); ``domain_group``
    is the DP×CP group. ``plan`` and ``stats[-1]`` are those of the batch last run. With a
    ``prefetcher`` (``integration.prefetch``), each training call prepares the next global batch
    in the background while its own runs; ``prefetch_next`` False (the last iteration) skips it.
    :meth:`use_cost_model` changes the cost model from the plan after next on: the next plan
    may already be made (with prefetch, and so also without it: both give the same plans).
    """

    forward_backward_func: Callable[..., Any]
    config: DCPConfig
    scheduler: Scheduler
    groups: DCPGroups
    dp_group: Any
    domain_group: Any
    stats: List[BatchStats] = field(default_factory=list)
    plan: Optional[Plan] = None
    # MoE with TP > 1: the TP × CP groups (``integration.process_groups``), named in each micro-batch.
    tp_cp_groups: Optional[DCPGroups] = None
    # MTP depth of the model: each micro-batch then names its global batch's MTP token ratios.
    mtp_depth: int = 0
    prefetcher: Optional[Prefetcher] = None
    prefetch_next: bool = True
    pending_cost: Optional[CostModel] = None
    # A vision-language model's tiles (``integration.vision_batches``); None: text only.
    vision: Optional[VisionSpec] = None

    def __call__(
        self,
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: Any,
        num_microbatches: int,
        seq_length: int = 0,
        micro_batch_size: int = 1,
        **kwargs: Any,
    ) -> Any:
        iterator, count = first_iterator(data_iterator), num_microbatches * micro_batch_size
        prepared = self.prefetcher.take(iterator, count) if self.prefetcher else None
        if prepared is not None:
            used_on_current_stream(prepared.batches)
        batches = self.publish(prepared or self.prepare_from(iterator, count, self.comm))
        if not kwargs.get("forward_only", False):
            self.advance_cost_model()
            if self.prefetcher and self.prefetch_next:
                self.prefetcher.start(iterator, count)
        set_variable_seq_lengths(model)
        shapes = pipeline_shapes(model, batches, kwargs.get("forward_only", False))
        try:
            with planned_shapes(shapes):
                return self.forward_backward_func(
                    forward_step_func=forward_step_func,
                    data_iterator=iterators_like(data_iterator, batches),
                    model=model,
                    num_microbatches=len(batches),
                    seq_length=max((b["tokens"].shape[-1] for b in batches), default=0),
                    micro_batch_size=1,
                    **kwargs,
                )
        except BaseException:
            self.close()  # no background collective or thread outlives a failed step
            raise

    @property
    def comm(self) -> Comm:
        return Comm(self.dp_group, self.domain_group)

    def close(self) -> None:
        """Wait for a background preparation to finish and drop it (end of training)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    def prepare(self, samples: Sequence[Sample]) -> List[Batch]:
        """Steps 2–4 for ``samples`` on the calling thread, recorded as the batch last run."""
        samples = [as_sample(s, self.vision is not None) for s in samples]
        return self.publish(self.prepare_samples(samples, self.comm))

    def prepare_from(self, iterator: Iterator[Any], count: int, comm: Comm) -> Prepared:
        """Steps 1–4: read ``count`` samples of ``iterator`` and prepare them over ``comm``."""
        return self.prepare_samples(take_samples(iterator, count, self.vision is not None), comm)

    def prepare_samples(self, samples: Sequence[Sample], comm: Comm) -> Prepared:
        """Steps 2–4: plan, route and pack this rank's micro-batches of one global batch over the
        groups of ``comm``. Samples travel on the device the domain's collectives use (the GPU
        under NCCL, else the CPU); every length and count is taken on the host, before the move:
        no value of a device tensor is read per micro-batch."""
        device = collective_device(comm.domain_group)
        samples, images = split_images(samples) if self.vision else (samples, None)
        lengths = gather_lengths([sample_length(s) for s in samples], comm.dp_group)
        tiles = exchange_tiles(images, comm.dp_group) if images is not None else None
        start = time.perf_counter()
        plan = plan_with(self.scheduler, lengths.seqlens, self.patches_of(tiles))
        plan_time = time.perf_counter() - start
        check_same_plan(plan, comm.domain_group, step=len(self.stats) + 1)
        moved = [{key: to_device(value, device) for key, value in s.items()} for s in samples]
        routed = self.route(plan, lengths, moved, comm)
        pictures = self.route_images(plan, lengths, tiles, images, comm, device)
        batches = [
            self.pack(plan, index, routed.samples, device, pictures)
            for index in range(plan.num_microbatches)
        ]
        if self.mtp_depth:  # counted on the host masks, before the move
            masks = [sample["loss_mask"] for sample in samples]
            ratios = mtp_token_ratios(masks, self.mtp_depth, comm.dp_group, device)
            for batch in batches:
                setattr(batch["packed_seq_params"], MTP_RATIOS_ATTRIBUTE, ratios)
        received = routed.bytes_received + (pictures.bytes_received if pictures else 0)
        stats = batch_stats(plan, plan_time, batches, received, self.scheduler)
        return Prepared(batches, plan, stats)

    def patches_of(self, tiles: Optional[BatchTiles]) -> Optional[List[int]]:
        """Each sample's encoder patches, what the planner prices (None for text)."""
        if tiles is None or self.vision is None:
            return None
        return [count * self.vision.patches_per_tile for count in tiles.tiles]

    def publish(self, prepared: Prepared) -> List[Batch]:
        """Record ``prepared`` as the batch being run (its plan and figures); its batches."""
        self.stats.append(prepared.stats)
        self.plan = prepared.plan
        return prepared.batches

    def use_cost_model(self, cost: CostModel) -> None:
        """Plan with ``cost`` from the plan after next on (every rank must pass the same one)."""
        self.pending_cost = cost

    def advance_cost_model(self) -> None:
        """At a training call, once its own batch is ready: the next plans use the cost model
        given before this call."""
        if self.pending_cost is not None:
            self.scheduler.cost_model, self.pending_cost = self.pending_cost, None

    def route(
        self, plan: Plan, lengths: GlobalLengths, samples: Sequence[Sample], comm: Comm
    ) -> RoutedSamples:
        """Step 3: send and receive samples so that this rank holds those of its groups, by the
        configured method (``--dcp-routing``): an all-to-all over the DP×CP group, or an
        all-gather over the DP group, which is this rank's CP lane (same CP rank, every DP
        rank)."""
        ids = lengths.ids_of(torch.distributed.get_rank(comm.dp_group))
        local = dict(zip(ids, samples))
        position, owner_of = self.groups.position, lengths.owner_of
        schema = VLM_SCHEMA if self.vision else SAMPLE_SCHEMA
        if routing_method(self.config.routing, comm.domain_group) == LANE_ALL_GATHER:
            return route_by_lane_all_gather(
                plan, local, position, comm.dp_group, owner_of, schema=schema
            )
        return route_samples(plan, local, position, comm.domain_group, owner_of, schema=schema)

    def route_images(
        self,
        plan: Plan,
        lengths: GlobalLengths,
        tiles: Optional[BatchTiles],
        images: Optional[Sequence[torch.Tensor]],
        comm: Comm,
        device: torch.device,
    ) -> Optional[RoutedImages]:
        """Step 3 for a vision-language batch's tiles: each to the rank of its CP group that
        encodes it, by the text's routing method (``integration.vision_batches``)."""
        if tiles is None or images is None:
            return None
        ids = lengths.ids_of(torch.distributed.get_rank(comm.dp_group))
        local = {i: to_device(image, device) for i, image in zip(ids, images)}
        method = routing_method(self.config.routing, comm.domain_group)
        route = TileRoute(
            method, self.groups.position, comm.domain_group, comm.dp_group, lengths.owner_of
        )
        pixels, received = route_tiles(plan, tiles, local, self.vision, route)
        return RoutedImages(tiles, pixels, received)

    def pack(
        self,
        plan: Plan,
        index: int,
        samples: Mapping[int, Sample],
        device: torch.device,
        images: Optional[RoutedImages] = None,
    ) -> Batch:
        """Step 4: this rank's share of micro-batch ``index``, on ``device`` (with its image
        tiles, for a vision-language model)."""
        group = plan.microbatches[index].group_of(self.groups.position)
        multiple = self.config.pad_multiple(group.size)
        extra: Tuple[str, ...] = ()
        if images is not None:
            counts = [images.tiles.tiles[i] for i in group.sample_ids]
            shifted = offset_slots([samples[i] for i in group.sample_ids], counts, self.vision)
            samples, extra = dict(zip(group.sample_ids, shifted)), (VISION_SLOT,)
        packed, cp_group = pack_group(
            group, samples, self.groups, multiple, self.config.pack_padding, extra
        )
        batch = batch_of(packed.to(device), cp_group)
        if images is not None:
            batch.update(self.vision_inputs(group, images, packed, cp_group, device))
        if self.tp_cp_groups is not None:
            tp_cp = tp_cp_group_for(self.tp_cp_groups, self.groups, group)
            setattr(batch["packed_seq_params"], TP_CP_GROUP_ATTRIBUTE, tp_cp)
        return batch

    def vision_inputs(
        self,
        group: CPGroup,
        images: RoutedImages,
        packed: PackedMicroBatch,
        cp_group: Any,
        device: torch.device,
    ) -> Batch:
        """The forward step's image inputs of one micro-batch: this rank's tiles, the image
        slots of its tokens and its :class:`~megatron_dcp.integration.vision_batches.VisionShare`."""
        position = self.groups.position
        tiles, share = micro_batch_images(
            group, position, images.tiles, images.routed, self.vision, cp_group
        )
        return {
            IMAGES: to_device(tiles, device),
            VISION_SLOT: packed.extras[VISION_SLOT].to(device),
            "vision_share": share,
        }


def routing_method(configured: str, domain_group: Any) -> str:
    """The routing ``--dcp-routing`` names; ``auto``: the all-to-all on gloo, where it measured
    faster and moves fewer bytes, the lane all-gather on NCCL, where it needs no point-to-point
    buffers per peer (docs/scaling.md, "Routing")."""
    if configured != AUTO_ROUTING:
        return configured
    gloo = torch.distributed.get_backend(domain_group) == "gloo"
    return ALL_TO_ALL if gloo else LANE_ALL_GATHER


def pack_group(
    group: CPGroup,
    samples: Mapping[int, Sample],
    groups: DCPGroups,
    pad_multiple: int,
    padding: PackPadding = NO_PADDING,
    extra_fields: Sequence[str] = (),
) -> Tuple[PackedMicroBatch, Any]:
    """This rank's zigzag share of a plan's CP ``group`` (its samples packed as THD, in plan
    order, the pack padded as ``padding`` says, ``extra_fields`` carried) and the group's
    communicator (None at size 1)."""
    packed = pack_samples(
        [samples[i] for i in group.sample_ids],
        group.size,
        groups.position - group.ranks[0],
        pad_multiple,
        padding,
        extra_fields,
    )
    return packed, groups.group_for(group)


def batch_of(packed: PackedMicroBatch, cp_group: Any) -> Batch:
    """The dict a forward step receives: tensors ``[1, T_local]``, this rank's loss-token count
    (``num_tokens``, a 0-dim tensor on the pack's device) and the ``PackedSeqParams``."""
    return {
        "tokens": packed.tokens,
        "labels": packed.labels,
        "loss_mask": packed.loss_mask,
        "position_ids": packed.position_ids,
        "num_tokens": packed.loss_tokens,  # a 0-dim tensor: counted without a host read
        "packed_seq_params": packed_seq_params_of(packed, cp_group),
    }


def packed_seq_params_of(packed: PackedMicroBatch, cp_group: Any, dynamic: bool = True) -> Any:
    """megatron's THD ``PackedSeqParams`` for one packed micro-batch. ``dynamic``: a DCP
    micro-batch naming its group (``cp_group`` None and ``local_cp_size`` 1 without CP); else
    static CP (no ``local_cp_size``: megatron uses the model's static CP group)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens,
        cu_seqlens_kv=packed.cu_seqlens,
        cu_seqlens_q_padded=packed.cu_seqlens_padded,
        cu_seqlens_kv_padded=packed.cu_seqlens_padded,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
        local_cp_size=packed.cp_size if dynamic else None,
        cp_group=cp_group if dynamic and packed.cp_size > 1 else None,
        total_tokens=packed.total_tokens,  # Mamba's seq_idx: no state crosses
    )


def batch_stats(
    plan: Plan,
    plan_time: float,
    batches: Sequence[Batch],
    bytes_received: int,
    scheduler: Scheduler,
) -> BatchStats:
    return BatchStats(
        num_microbatches=plan.num_microbatches,
        cp_size_histogram=plan.cp_size_histogram(),
        plan_time_s=plan_time,
        sum_seqlen=sum(plan.seqlens),
        sum_seqlen_squared=sum(length * length for length in plan.seqlens),
        local_tokens=sum(int(b["tokens"].shape[-1]) for b in batches),
        bytes_received=bytes_received,
        estimated_imbalance=plan_imbalance(plan, scheduler.cost_model),
        predicted_step_s=predicted_step_time(plan, scheduler.cost_model),
        encoder_tiles=sum(b["vision_share"].local_tiles for b in batches if "vision_share" in b),
    )


def used_on_current_stream(batches: Sequence[Batch]) -> None:
    """Mark the CUDA tensors of ``batches`` (made on the prefetch stream) as used on the current
    stream, so that their memory is not reused while the step still reads it."""
    if not torch.cuda.is_available():
        return
    stream = torch.cuda.current_stream()
    for batch in batches:
        params = vars(batch["packed_seq_params"]).values()  # its cu_seqlens tensors
        for value in [*batch.values(), *params]:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(stream)


def sample_length(sample: Sample) -> int:
    return int(sample["tokens"].numel())


def as_sample(item: Mapping[str, Any], vision: bool = False) -> Sample:
    """A sample as 1-D tensors: megatron's data loader collates one sample to ``[1, L]``. A
    vision-language sample (``vision``) also has ``vision_slot`` and its ``images``
    ``[tiles, C, H, W]``."""
    sample = {}
    if vision:
        sample[IMAGES] = vision_images(item)
    for key in (*SAMPLE_KEYS, VISION_SLOT) if vision else SAMPLE_KEYS:
        if key not in item:
            raise ValueError(
                f"a DCP sample needs the fields {SAMPLE_KEYS}; got {sorted(item)}. The dataset "
                "must yield one variable-length sequence per sample (see docs/usage.md)."
            )
        value = torch.as_tensor(item[key])
        if value.dim() == 2 and value.shape[0] != 1:
            raise ValueError(
                f"DCP needs --micro-batch-size 1 (got micro-batches of {value.shape[0]} "
                "sequences): the plan forms the micro-batches; --global-batch-size counts sequences."
            )
        sample[key] = value.reshape(-1).to(SAMPLE_DTYPES.get(key, torch.int64))
    return sample


def take_samples(iterator: Iterator[Any], count: int, vision: bool = False) -> List[Sample]:
    """The next ``count`` samples (a ``StopIteration`` mid-batch is a data-loader error)."""
    samples = []
    for _ in range(count):
        try:
            samples.append(as_sample(next(iterator), vision))
        except StopIteration:
            raise ValueError(
                f"the data iterator ran out after {len(samples)} of the {count} samples this "
                "rank's share of the global batch needs (num_microbatches × micro_batch_size)."
            ) from None
    return samples


def first_iterator(data_iterator: Any) -> Iterator[Sample]:
    """With VPP megatron passes one iterator per model chunk; the samples come from the first."""
    return data_iterator[0] if isinstance(data_iterator, list) else data_iterator


def iterators_like(data_iterator: Any, batches: List[Batch]) -> Any:
    """One iterator over ``batches``, or one per model chunk when the caller passed a list."""
    if isinstance(data_iterator, list):
        return [iter(batches) for _ in data_iterator]
    return iter(batches)


def set_variable_seq_lengths(model: Any) -> None:
    """Micro-batches differ in length: megatron's pipeline p2p must size each message by itself
    (its shape exchange, which a DCP step answers from the plan: :func:`pipeline_shapes`)."""
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, list) else [model]
    get_model_config(chunks[0]).variable_seq_lengths = True


def pipeline_shapes(model: Any, batches: Sequence[Batch], forward_only: bool) -> PlannedShapes:
    """The pipeline messages of a step over ``batches`` (``integration.patches.pipeline_shapes``):
    their token counts are host sizes, and the stages of this rank's pipeline hold the same ones
    (one DP×CP position), so no stage asks its neighbours."""
    from megatron.core.utils import get_model_config

    chunks = model if isinstance(model, list) else [model]
    config = get_model_config(chunks[0])
    return PlannedShapes(
        local_tokens=tuple(int(batch["tokens"].shape[-1]) for batch in batches),
        hidden_size=config.hidden_size,
        num_chunks=len(chunks),
        group_size=config.microbatch_group_size_per_vp_stage or 1,
        sequence_divisor=config.tensor_model_parallel_size if config.sequence_parallel else 1,
        forward_only=forward_only,
    )


def build_forward_backward(
    model_config: Any,
    config: DCPConfig,
    groups: Optional[DCPGroups] = None,
    forward_backward_func: Optional[Callable[..., Any]] = None,
    vision: Optional[VisionSpec] = None,
) -> DCPForwardBackward:
    """The DCP wrapper around ``get_forward_backward_func()`` for a model with ``model_config``
    (its TransformerConfig), which must agree with ``config`` on the parallel sizes;
    ``vision``: the tiles of a vision-language model (``integration.vision_batches``)."""
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
        vision=vision,
    )
    if config.prefetch:
        wrapper.prefetcher = Prefetcher(wrapper.prepare_from, dedicated_comm(wrapper.comm))
    return wrapper
