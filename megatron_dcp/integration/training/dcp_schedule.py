"""DCP inside ``megatron.training``: the schedule that ``pretrain``'s training and evaluation loops
run in place of megatron's forward-backward function, the online refinement of its cost model,
and its ``[DCP]`` log line."""

from __future__ import annotations

import atexit
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.integration.forward_backward import BatchStats, DCPForwardBackward
from megatron_dcp.integration.node_layout import describe_layout
from megatron_dcp.integration.patches import apply_groups, timed, timing_steps, use_schedule
from megatron_dcp.integration.vision_batches import VisionSpec
from megatron_dcp.integration.training.time_groups import TimeGroups, time_groups
from megatron_dcp.scheduling.cost_fit import (
    OnlineRefinement,
    Vector,
    microbatch_features,
    microbatch_points,
    rank_features,
)
from megatron_dcp.scheduling.metrics import imbalance as max_over_mean

# Short names of the refined coefficients in the log line (cost_fit.FEATURES, in order).
COEFFICIENT_LABELS = ("a", "b", "b_cp", "comm", "ring", "mb", "spill", "seq", "vis")
# The [DCP] line's words for an untimed step (adaptation off and no tool asking for the times).
NOT_TIMED = "step not timed (--dcp-cost-adapt off)"


class DCPSchedule:
    """Stands in for megatron's forward-backward function inside ``megatron.training``: builds
    the :class:`DCPForwardBackward` on its first call (the model's config is known then and the
    model-parallel groups exist), refines the cost model after every training step (unless
    ``cost_adapt`` is off) and logs the DCP figures of every training iteration. Training steps
    are timed only for the refinement or when ``DCPConfig.time_steps`` asks (the measuring
    tools); evaluation steps never."""

    def __init__(
        self,
        config: DCPConfig,
        log: Callable[[str], None],
        iteration: Optional[Callable[[], int]] = None,
        last_iteration: Optional[Callable[[], bool]] = None,
        vision: Optional[VisionSpec] = None,
    ) -> None:
        """``iteration`` returns the number of the training iteration being run (megatron's,
        which continues after a resume); default: count the training calls.
        ``last_iteration`` says whether it is the last (no next batch to prefetch then).
        ``vision``: the image tiles of a vision-language model (None: text only)."""
        self.config, self.log, self.vision = config, log, vision
        self.last_iteration = last_iteration or (lambda: False)
        self.wrapper: Optional[DCPForwardBackward] = None
        self.refinement: Optional[OnlineRefinement] = None
        self.calls = 0
        self.iteration = iteration or (lambda: self.calls)
        self.times: Optional[StepTimes] = None  # the last training step's
        self.time_groups: Optional[TimeGroups] = None  # made with the wrapper, when timing

    def __call__(self, **kwargs: Any) -> Any:
        wrapper = self.wrapper or self.build(kwargs["model"])
        wrapper.prefetch_next = not self.last_iteration()
        if kwargs.get("forward_only", False):
            return wrapper(**kwargs)
        if not self.times_steps:
            losses = wrapper(**kwargs)
            self.calls += 1
            self.log(self.describe(wrapper.stats[-1]))
            return losses
        return self.timed_step(wrapper, kwargs)

    @property
    def times_steps(self) -> bool:
        """Whether training steps are timed: for the refinement (``cost_adapt``) or because a
        tool asked for the times (``time_steps``). Untimed, the schedule adds no
        synchronisation and no collective to megatron's step."""
        return self.config.cost_adapt or self.config.time_steps

    def timed_step(self, wrapper: DCPForwardBackward, kwargs: dict) -> Any:
        """One training call, its forward and backward steps timed: the step's times read once
        it has run (on CUDA its one synchronisation), gathered, refined on and logged."""
        forward_step_func = kwargs.pop("forward_step_func")
        start = time.perf_counter()
        with timing_steps() as clock:
            losses = wrapper(forward_step_func=timed(forward_step_func, clock), **kwargs)
        self.calls += 1
        count = wrapper.plan.num_microbatches if wrapper.plan is not None else 0
        values = clock.per_microbatch(count)  # reads the CUDA events: waits for the step
        elapsed = time.perf_counter() - start
        times = StepTimes.of(busy_times(values, self.time_groups))
        self.times = times
        self.refine(times)
        self.log(self.describe(wrapper.stats[-1], elapsed, times.totals))
        return losses

    def build(self, model: Any) -> DCPForwardBackward:
        from megatron.core.utils import get_model_config

        from megatron_dcp.integration.forward_backward import build_forward_backward

        chunks = model if isinstance(model, list) else [model]
        self.wrapper = build_forward_backward(
            get_model_config(chunks[0]), self.config, vision=self.vision
        )
        atexit.register(self.wrapper.close)  # an early exit (signal, --exit-interval) joins too
        if self.wrapper.config.cost_adapt:
            self.refinement = OnlineRefinement(self.wrapper.scheduler.cost_model)
        if self.times_steps:
            self.time_groups = time_groups(self.wrapper.domain_group)
        self.log(" " + self.wrapper.groups.report())
        self.log(" " + describe_layout(self.wrapper.scheduler.cost_model.nodes))
        self.log(" " + describe_prefetch(self.wrapper))
        return self.wrapper

    def refine(self, times: "StepTimes") -> None:
        """Fit the cost model to the measured ``times`` of the step's plan (the same floats in the
        same order on every rank) and plan the next global batch with it: one point per
        position and micro-batch, or per position where a rank's seconds were not all claimed
        by a micro-batch."""
        if self.refinement is None or self.wrapper is None or self.wrapper.plan is None:
            return
        prior, plan = self.refinement.prior, self.wrapper.plan
        if times.per_microbatch:
            features = microbatch_features(plan, prior.nodes, prior.spill_elements)
            rows, values = microbatch_points(features, times.microbatches)
        else:
            rows = rank_features(plan, prior.nodes, prior.spill_elements)
            values = times.totals
        cost = self.refinement.update(rows, values)
        self.wrapper.use_cost_model(cost)

    def describe(
        self,
        stats: BatchStats,
        elapsed_s: Optional[float] = None,
        times: Optional[Sequence[float]] = None,
    ) -> str:
        """One log line. ``times`` are the busy forward-backward seconds per position (see
        :func:`busy_times`): the measured imbalance is their max/mean, the measured step time
        their max, tokens/s the batch's tokens over ``elapsed_s``; the predicted step time is
        the plan's under the cost model that planned it. Without ``times`` (the step was not
        timed) the line says so in place of the measured figures."""
        sizes = " ".join(f"{size}:{count}" for size, count in stats.cp_size_histogram.items())
        line = (
            f" [DCP] iteration {self.iteration():8d} | micro-batches: {stats.num_microbatches} | "
            f"CP sizes (size:seqs): {sizes} | plan time (ms): {stats.plan_time_s * 1e3:.1f} | "
        )
        if times is None or elapsed_s is None:
            return line + (
                f"load imbalance est.: {stats.estimated_imbalance:.3f} | "
                f"fwd-bwd time (ms) pred.: {stats.predicted_step_s * 1e3:.1f} | "
                f"{NOT_TIMED}"
            )
        line += (
            f"load imbalance est./meas.: {stats.estimated_imbalance:.3f}/"
            f"{max_over_mean(list(times)):.3f} | "
            f"fwd-bwd time (ms) pred./meas.: {stats.predicted_step_s * 1e3:.1f}/"
            f"{max(times, default=0.0) * 1e3:.1f} | "
            f"tokens/s: {stats.sum_seqlen / max(elapsed_s, 1e-9):.0f}"
        )
        return line + self.describe_refinement()

    def describe_refinement(self) -> str:
        """The refined coefficients as factors of the prior's (empty when not refining)."""
        if self.refinement is None:
            return ""
        prior = self.refinement.prior
        skipped = set()  # terms the prior has none of: nothing to refine
        if math.isinf(prior.spill_elements):
            skipped.add("spill")  # no cache size: nothing spills
        if prior.sequence == 0:
            skipped.add("seq")  # kernels that take a whole pack at once
        if prior.vision == 0:
            skipped.add("vis")  # no vision encoder
        factors = " ".join(
            f"{label} {factor:.3g}"
            for label, factor in zip(COEFFICIENT_LABELS, self.refinement.factors)
            if label not in skipped
        )
        return f" | cost x prior: {factors}"


def describe_prefetch(wrapper: DCPForwardBackward) -> str:
    if wrapper.prefetcher is None:
        return "DCP prefetch: off (each global batch is read, planned and routed before its step)"
    return (
        "DCP prefetch: on (the next global batch is read, planned and routed in the background "
        "while the current one trains)"
    )


@dataclass(frozen=True)
class StepTimes:
    """One step's busy forward-backward seconds per position of the domain (the same floats on
    every rank): per micro-batch of the plan, and those no micro-batch claimed."""

    microbatches: List[Vector]  # [position][micro-batch]
    unclaimed: Vector  # per position

    @classmethod
    def of(cls, rows: Sequence[Sequence[float]]) -> "StepTimes":
        """From :func:`busy_times`' rows, ``[unclaimed, micro-batch 0, …]`` per position."""
        return cls([list(row[1:]) for row in rows], [row[0] for row in rows])

    @property
    def totals(self) -> Vector:
        """Per position, every busy second of the step."""
        return [u + sum(m) for u, m in zip(self.unclaimed, self.microbatches)]

    @property
    def per_microbatch(self) -> bool:
        """True when every second was claimed by a micro-batch, on every position."""
        return not any(self.unclaimed)


def busy_times(values: Sequence[float], groups: TimeGroups) -> List[Vector]:
    """Every position's ``values`` (its busy seconds: ``BusyClock.per_microbatch``), the same
    floats on every rank of the job: gathered (float64) over the DP×CP domain, the slowest of
    the tensor-parallel ranks (they run in step), summed over the pipeline stages in stage order
    (each runs its share of the layers; the cost model counts them all), value by value. One
    all-gather per group, as many floats per rank as micro-batches + 1, all on the host
    (``time_groups``: gloo), so nothing waits for the GPU."""
    width = len(values)
    local = torch.tensor(list(values), dtype=torch.float64)
    times = torch.cat(gather_tensors(local, groups.domain))
    if groups.tp is not None:
        times = torch.stack(gather_tensors(times, groups.tp)).amax(dim=0)
    if groups.pp is not None:
        stages = gather_tensors(times, groups.pp)
        times = stages[0].clone()
        for stage in stages[1:]:  # in stage order, as a sum of floats on the host would add
            times += stage
    flat = times.tolist()
    return [flat[i : i + width] for i in range(0, len(flat), width)]


def gather_tensors(local: torch.Tensor, group: Any) -> List[torch.Tensor]:
    """Every rank's ``local`` (all of one shape, on the host), by rank in ``group`` (gloo)."""
    parts = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return parts


def install_dcp_schedule(
    config: DCPConfig,
    log: Callable[[str], None],
    schedule_class: type = DCPSchedule,
    vision: Optional[VisionSpec] = None,
) -> DCPSchedule:
    """Make ``megatron.training``'s loops run one shared :class:`DCPSchedule` (or a subclass,
    ``schedule_class``: the training benchmark's) through the ``dcp_schedule`` entry of the
    patch table; ``vision``: a vision-language model's tiles (``pretrain_vlm``)."""
    from megatron.training import get_args

    def last_iteration() -> bool:
        args = get_args()
        return bool(args.train_iters) and args.curr_iteration + 1 >= args.train_iters

    schedule = schedule_class(
        config,
        log,
        iteration=lambda: get_args().curr_iteration + 1,
        last_iteration=last_iteration,
        vision=vision,
    )
    apply_groups(("training",))
    use_schedule(schedule)
    return schedule
