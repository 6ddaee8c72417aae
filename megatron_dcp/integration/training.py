"""DCP inside ``megatron.training``: the command-line flags, their validation, and the hook that
makes ``pretrain``'s training and evaluation loops run the DCP forward-backward wrapper."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from megatron_dcp.integration.schedule import BatchStats, DCPForwardBackward
from megatron_dcp.integration.validation import (
    DCP_FLAG,
    validate_budget,
    validate_scheduler_name,
)
from megatron_dcp.scheduling.domain import MIN_CP_FLAG, is_power_of_two


def add_dcp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron ``extra_args_provider``: the DCP flags (upstream's names) and the data flags."""
    group = parser.add_argument_group("dynamic context parallelism (megatron_dcp)")
    group.add_argument(
        DCP_FLAG,
        action="store_true",
        help="Plan every global batch: one CP "
        "group per sequence, balanced THD micro-batches (docs/usage.md).",
    )
    group.add_argument(
        MIN_CP_FLAG,
        type=int,
        default=1,
        help="Smallest CP group size DCP " "may use (a power of two).",
    )
    group.add_argument(
        "--sequence-packing-scheduler",
        default=None,
        choices=("default_dynamic_cp", "dp_balanced"),
        help="Scheduler of DCP "
        "(default default_dynamic_cp); dp_balanced is the static-CP baseline.",
    )
    group.add_argument(
        "--varlen-distribution",
        default=None,
        help="Mock variable-length " "data, e.g. 'lognormal:mean=1024,sigma=1.5,min=128,max=8192'.",
    )
    group.add_argument(
        "--varlen-lengths-file",
        default=None,
        help="Mock data whose lengths " "are read from this file (one per line).",
    )
    return parser


@dataclass(frozen=True)
class DCPSettings:
    """The DCP part of the arguments, validated."""

    scheduler: str
    max_seqlen_per_dp_cp_rank: int
    min_cp_size: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DCPSettings":
        """Raise a ValueError naming the flag for every setting DCP cannot run with."""
        if not is_power_of_two(args.min_dynamic_context_parallel_size):
            raise ValueError(
                f"{MIN_CP_FLAG}={args.min_dynamic_context_parallel_size}: must be a power of two "
                "(1, 2, 4, ...) no larger than data-parallel size × context-parallel size."
            )
        if args.micro_batch_size != 1:
            raise ValueError(
                f"--micro-batch-size={args.micro_batch_size}: {DCP_FLAG} forms the micro-batches "
                "itself; use --micro-batch-size 1 (--global-batch-size counts sequences)."
            )
        budget = validate_budget(
            args.max_seqlen_per_dp_cp_rank, args.tensor_model_parallel_size, args.sequence_parallel
        )
        return cls(
            scheduler=validate_scheduler_name(args.sequence_packing_scheduler),
            max_seqlen_per_dp_cp_rank=budget,
            min_cp_size=args.min_dynamic_context_parallel_size,
        )


class DCPSchedule:
    """Stands in for megatron's forward-backward function inside ``megatron.training``: builds
    the :class:`DCPForwardBackward` on its first call (the model's config is known then and the
    model-parallel groups exist), and logs the DCP figures of every training iteration."""

    def __init__(
        self,
        settings: DCPSettings,
        log: Callable[[str], None],
        iteration: Optional[Callable[[], int]] = None,
    ) -> None:
        """``iteration`` returns the number of the training iteration being run (megatron's,
        which continues after a resume); default: count the training calls."""
        self.settings, self.log = settings, log
        self.wrapper: Optional[DCPForwardBackward] = None
        self.calls = 0
        self.iteration = iteration or (lambda: self.calls)

    def __call__(self, **kwargs: Any) -> Any:
        wrapper = self.wrapper or self.build(kwargs["model"])
        step = TimedForwardStep(kwargs.pop("forward_step_func"))
        start = time.perf_counter()
        losses = wrapper(forward_step_func=step, **kwargs)
        if not kwargs.get("forward_only", False):
            self.calls += 1
            elapsed = time.perf_counter() - start
            self.log(self.describe(wrapper.stats[-1], elapsed, step.busy_s))
        return losses

    def build(self, model: Any) -> DCPForwardBackward:
        from megatron.core.utils import get_model_config

        from megatron_dcp.integration.dcp import build_forward_backward

        chunks = model if isinstance(model, list) else [model]
        self.wrapper = build_forward_backward(
            get_model_config(chunks[0]),
            self.settings.max_seqlen_per_dp_cp_rank,
            self.settings.scheduler,
            self.settings.min_cp_size,
        )
        self.log(" " + self.wrapper.groups.report())
        return self.wrapper

    def describe(self, stats: BatchStats, elapsed_s: float, busy_s: float) -> str:
        """One log line; the measured imbalance is max/mean over the domain of the time each rank
        spent in forward passes (a collective over the DP×CP group)."""
        measured = imbalance(busy_s, self.wrapper.domain_group)
        sizes = " ".join(f"{size}:{count}" for size, count in stats.cp_size_histogram.items())
        return (
            f" [DCP] iteration {self.iteration():8d} | micro-batches: {stats.num_microbatches} | "
            f"CP sizes (size:seqs): {sizes} | plan time (ms): {stats.plan_time_s * 1e3:.1f} | "
            f"load imbalance est./meas.: {stats.estimated_imbalance:.3f}/{measured:.3f} | "
            f"tokens/s: {stats.sum_seqlen / max(elapsed_s, 1e-9):.0f}"
        )


class TimedForwardStep:
    """A forward step that adds up the time spent in it (this rank's forward work)."""

    def __init__(self, forward_step_func: Callable) -> None:
        self.forward_step_func = forward_step_func
        self.busy_s = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.forward_step_func(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start


def imbalance(busy_s: float, group: Any) -> float:
    """max/mean of ``busy_s`` over ``group``."""
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(values, torch.tensor([busy_s], dtype=torch.float64), group=group)
    times: List[float] = [value.item() for value in values]
    mean = sum(times) / len(times)
    return max(times) / mean if mean > 0 else 1.0


def install_dcp_schedule(settings: DCPSettings, log: Callable[[str], None]) -> DCPSchedule:
    """Make ``megatron.training``'s loops use DCP: its ``get_forward_backward_func`` (imported
    into ``megatron.training.training``) returns one shared :class:`DCPSchedule`."""
    from megatron.training import get_args, training

    schedule = DCPSchedule(settings, log, iteration=lambda: get_args().curr_iteration + 1)
    training.get_forward_backward_func = lambda *args, **kwargs: schedule
    return schedule
