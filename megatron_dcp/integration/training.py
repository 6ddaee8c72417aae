"""DCP inside ``megatron.training``: the schedule that ``pretrain``'s training and evaluation loops
run in place of megatron's forward-backward function, and its ``[DCP]`` log line."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.integration.patches import apply_groups, use_schedule
from megatron_dcp.integration.schedule import BatchStats, DCPForwardBackward
from megatron_dcp.scheduling.metrics import imbalance as max_over_mean


class DCPSchedule:
    """Stands in for megatron's forward-backward function inside ``megatron.training``: builds
    the :class:`DCPForwardBackward` on its first call (the model's config is known then and the
    model-parallel groups exist), and logs the DCP figures of every training iteration."""

    def __init__(
        self,
        config: DCPConfig,
        log: Callable[[str], None],
        iteration: Optional[Callable[[], int]] = None,
    ) -> None:
        """``iteration`` returns the number of the training iteration being run (megatron's,
        which continues after a resume); default: count the training calls."""
        self.config, self.log = config, log
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
        self.wrapper = build_forward_backward(get_model_config(chunks[0]), self.config)
        self.log(" " + self.wrapper.groups.report())
        return self.wrapper

    def describe(self, stats: BatchStats, elapsed_s: float, busy_s: float) -> str:
        """One log line; the measured imbalance is max/mean over the domain of the time each rank
        spent in forward passes (a collective over the DP×CP group)."""
        measured = measured_imbalance(busy_s, self.wrapper.domain_group)
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


def measured_imbalance(busy_s: float, group: Any) -> float:
    """max/mean of ``busy_s`` over ``group``."""
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(values, torch.tensor([busy_s], dtype=torch.float64), group=group)
    return max_over_mean([value.item() for value in values])


def install_dcp_schedule(config: DCPConfig, log: Callable[[str], None]) -> DCPSchedule:
    """Make ``megatron.training``'s loops run one shared :class:`DCPSchedule` (through the
    ``dcp_schedule`` entry of the patch table)."""
    from megatron.training import get_args

    schedule = DCPSchedule(config, log, iteration=lambda: get_args().curr_iteration + 1)
    apply_groups(("training",))
    use_schedule(schedule)
    return schedule
