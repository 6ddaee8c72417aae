"""The timing entry of the patch table: the busy seconds of megatron's backward steps on this
rank, for the ``[DCP]`` log line's measured step time and the online refinement of the cost
model (``integration.training.dcp_schedule``).

megatron's schedules call the module function ``schedules.backward_step`` once per micro-batch
(and model chunk); the patched one adds its duration to the :class:`BusyClock` that
:func:`timing_backward` has made current, and is the original when none is.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Tuple

from megatron_dcp.integration.patches.table import Patch


class BusyClock:
    """Seconds spent in the timed calls since the clock was made."""

    def __init__(self) -> None:
        self.busy_s = 0.0

    def add(self, seconds: float) -> None:
        self.busy_s += seconds


class ClockSlot:
    """The clock the patched ``backward_step`` adds to (None: not timing)."""

    clock: Optional[BusyClock] = None


SLOT = ClockSlot()


def now() -> float:
    """``time.perf_counter()`` once the GPU has finished the work queued so far (kernels run
    asynchronously: without the synchronisation a step would be timed at its launch cost)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextmanager
def timing_backward() -> Iterator[BusyClock]:
    """A clock of the backward steps run inside the block (0 when the patch is not applied)."""
    clock, previous = BusyClock(), SLOT.clock
    SLOT.clock = clock
    try:
        yield clock
    finally:
        SLOT.clock = previous


def timed(function: Callable, clock: BusyClock) -> Callable:
    """``function`` adding the duration of each call to ``clock``."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        start = now()
        try:
            return function(*args, **kwargs)
        finally:
            clock.add(now() - start)

    return call


def _timed_backward_step(owner: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def backward_step(*args: Any, **kwargs: Any) -> Any:
        clock = SLOT.clock
        if clock is None:
            return original(*args, **kwargs)
        return timed(original, clock)(*args, **kwargs)

    return backward_step


TIMING_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "backward_step_timer",
        "dcp",
        ("megatron.core.pipeline_parallel.schedules:backward_step",),
        "megatron's schedules time no rank's own work; the [DCP] log line's measured "
        "forward-backward time and the online refinement of the cost model need each rank's "
        "busy seconds in backward steps (forward steps are timed by the DCP schedule).",
        _timed_backward_step,
    ),
)
