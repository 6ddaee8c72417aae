"""The ranks of ``megatron-dcp calibrate``: time one packed micro-batch's forward + backward of
the real GPT model on the real CP groups, for every point of the calibration grid.

Every rank builds the model from megatron's arguments as ``pretrain_gpt`` does on CPU
(``gpt_config_from_args``, the reference THD/CP attention), joins megatron's model-parallel
state (tp = pp = cp = 1: the N ranks form one DP×CP domain) and the DCP groups of that domain
(:class:`~megatron_dcp.runtime.groups.DCPGroups`). A point with CP size ``c`` runs on every
aligned block of ``c`` ranks at once (each block packs the same sequences; ranks outside a full
block wait at the next barrier), so all cores are busy as in training. Every timing starts
with a world barrier and times, on each rank, forward + loss (sum of per-token losses) +
backward. One warm-up pass over the grid, then ``repeats`` passes; in each, a point shorter than
:data:`SHORT_POINT_S` is timed several times in a row (as many as fit in that time, at most
:data:`MAX_TIMINGS_PER_PASS`), since short points suffer most from other processes.
:func:`point_times` turns the per-rank timings into one time per point: the max over a block's
members (the group waits for its slowest rank), then the min over blocks and timings.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost_fit import MICROBATCH, Vector, group_features

# torch and megatron are imported where used: ``megatron-dcp`` builds its parser from this module.

# Per rank: [point][timing] seconds, None where the rank sat the point out.
RankTimes = List[List[Optional[float]]]
SHORT_POINT_S = 0.25
MAX_TIMINGS_PER_PASS = 8


@dataclass(frozen=True)
class Point:
    """One grid point: the sequences one CP group packs in one micro-batch, and its size;
    ``spill_elements`` is the score elements of one sequence's block that stay in cache
    (``CostModel.spill_elements``, from the hardware profile: the spill term's threshold)."""

    lengths: Tuple[int, ...]
    cp_size: int
    spill_elements: float = math.inf

    def features(self) -> Vector:
        """The cost-fit features of one rank of the group: one micro-batch (its own timing:
        the micro-batch cost is fitted from per-micro-batch times), these sequences, the
        score elements beyond the cache."""
        row = group_features(self.lengths, self.cp_size, spill_elements=self.spill_elements)
        row[MICROBATCH] += 1.0
        return row

    def label(self) -> str:
        """``4x512`` for four sequences of 512 tokens, else the lengths joined by ``+``."""
        if len(set(self.lengths)) == 1:
            return f"{len(self.lengths)}x{self.lengths[0]}"
        return "+".join(str(n) for n in self.lengths)


@dataclass(frozen=True)
class TimingJob:
    """What every rank measures: the points, the timed passes after the warm-up, the seed."""

    points: Tuple[Point, ...]
    repeats: int
    seed: int


def measure(args: argparse.Namespace, job: TimingJob, nproc: int, timeout_s: float) -> List[float]:
    """Seconds per point of ``job`` measured on ``nproc`` gloo ranks (module docstring); raises
    ``DistributedTestError`` when a rank fails, dies or runs past ``timeout_s``."""
    from megatron_dcp.tools.launching.local_ranks import run_distributed

    per_rank = run_distributed(
        _time_grid,
        nproc,
        args,
        job,
        backend="gloo",
        timeout_s=timeout_s,
        collective_timeout_s=timeout_s,
    )
    return point_times(per_rank, job.points)


def point_times(per_rank: Sequence[RankTimes], points: Sequence[Point]) -> List[float]:
    """One time per point: max over each block's members, min over blocks and timings."""
    world = len(per_rank)
    times = []
    for index, point in enumerate(points):
        c = point.cp_size
        samples = [
            max(per_rank[rank][index][timing] for rank in range(start, start + c))
            for timing in range(len(per_rank[0][index]))
            for start in range(0, world // c * c, c)
        ]
        times.append(min(samples))
    return times


def _time_grid(rank: int, world_size: int, args: argparse.Namespace, job: TimingJob) -> RankTimes:
    """One rank: build the model and the DCP groups, warm every point up once, then time it
    ``repeats`` times (several times per pass when short); the timings of every point."""
    # Each forward under megatron's CUDA-RNG tracker stand-in warns once per layer on CPU.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    from megatron_dcp.integration.model_parallel import init_megatron
    from megatron_dcp.integration.patches import apply_patches
    from megatron_dcp.runtime.groups import DCPGroups

    init_megatron(seed=args.seed)
    apply_patches()
    model = build_model(args)
    groups = DCPGroups.create([list(range(world_size))], min_cp_size=1)
    try:
        batches = [
            _micro_batch(point, groups, args, job.seed + i) for i, point in enumerate(job.points)
        ]
        counts = _timings_per_pass([_time_point(model, batch) for batch in batches])
        progress = _pass_progress(rank, job)
        timings: RankTimes = [[] for _ in batches]
        for done in range(1, job.repeats + 1):
            for batch, count, mine in zip(batches, counts, timings):
                mine.extend(_time_point(model, batch) for _ in range(count))
            progress(done)
    finally:
        groups.destroy()
    return timings


def _pass_progress(rank: int, job: TimingJob) -> Callable[[int], None]:
    """Rank 0 reports each timed pass over the grid, between passes (never inside a timing)."""
    if rank != 0:
        return lambda done: None
    from megatron_dcp.tools.progress import Progress

    progress = Progress("calibrate", job.repeats, f"timed passes of {len(job.points)} points")
    return progress.update


def _timings_per_pass(warm_up: Sequence[Optional[float]]) -> List[int]:
    """How often each point is timed per pass, from its warm-up (the slowest rank's, agreed by
    an all-reduce so that every rank runs the same barriers)."""
    import torch
    import torch.distributed as dist

    slowest = torch.tensor([t or 0.0 for t in warm_up], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [
        max(1, min(MAX_TIMINGS_PER_PASS, int(SHORT_POINT_S / max(t, 1e-6))))
        for t in slowest.tolist()
    ]


def build_model(args: argparse.Namespace) -> Any:
    """The GPT model of megatron's ``args`` as ``pretrain_gpt`` builds it on CPU (one stage,
    no DDP wrapper: gradients are reduced once per step, outside a micro-batch's time)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_dcp.integration.cpu.gpt_layer_spec import local_gpt_layer_spec

    model_config = gpt_config_from_args(args)
    model_config.transformer_layer_spec = local_gpt_layer_spec
    model_config.finalize()
    builder = GPTModelBuilder(model_config)
    return builder.build_model(ProcessGroupCollection.use_mpu_process_groups())


@dataclass(frozen=True)
class _Batch:
    """This rank's packed share of a point (None: the rank sits the point out)."""

    packed: Any  # PackedMicroBatch
    params: Any  # megatron's PackedSeqParams


def _micro_batch(
    point: Point, groups: Any, args: argparse.Namespace, seed: int
) -> Optional[_Batch]:
    """This rank's THD share of the point's micro-batch on its block of ``point.cp_size`` ranks
    (every block packs the same random sequences), or None outside every full block."""
    import torch

    from megatron_dcp.integration.forward_backward import packed_seq_params_of
    from megatron_dcp.runtime.packing import pack_samples, padding_multiple

    c = point.cp_size
    if groups.position >= groups.domain_size // c * c:
        return None
    generator = torch.Generator().manual_seed(seed)
    vocab = args.padded_vocab_size or args.vocab_size
    samples = []
    for length in point.lengths:
        stream = torch.randint(0, vocab, (length + 1,), generator=generator)
        samples.append(
            {"tokens": stream[:-1], "labels": stream[1:], "loss_mask": torch.ones(length)}
        )
    packed = pack_samples(samples, c, groups.position % c, padding_multiple(c))
    return _Batch(packed, packed_seq_params_of(packed, groups.group(c)))


def _time_point(model: Any, batch: Optional[_Batch]) -> Optional[float]:
    """Seconds of one forward + backward after a world barrier (None when sitting out)."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    dist.barrier()
    if batch is None:
        return None
    packed = batch.packed
    start = time.perf_counter()
    losses = model(
        input_ids=packed.tokens,
        position_ids=packed.position_ids,
        attention_mask=None,
        labels=packed.labels,
        packed_seq_params=batch.params,
    )
    (losses * packed.loss_mask).sum().backward()
    return time.perf_counter() - start
