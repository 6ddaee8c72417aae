"""The timing entries of the patch table: the busy seconds of megatron's forward and backward
steps on this rank, per micro-batch, for the ``[DCP]`` log line's measured step time and the
online refinement of the cost model (``integration.training.dcp_schedule``). A clock is made
only while the DCP schedule times a training step (``--dcp-cost-adapt on``, or a tool that asks
for the times: ``DCPConfig.time_steps``); otherwise the patched steps are megatron's.

megatron's schedules call the module functions ``schedules.forward_step`` and
``schedules.backward_step`` once per micro-batch (and model chunk). While a :class:`BusyClock`
is current (:func:`timing_steps`):

- the patched ``forward_step`` makes its ``current_microbatch`` (every schedule of
  megatron-core 0.19 passes it: the micro-batch's index, per model chunk under VPP) the clock's
  current micro-batch, so that the timed forward step function (:func:`timed`) adds its seconds
  to that micro-batch, and remembers which micro-batch its output belongs to;
- the patched ``backward_step`` adds its seconds to the micro-batch whose output it receives
  (the very object ``forward_step`` returned: every schedule hands it from the forward to the
  backward step).

Seconds no micro-batch claims (a schedule that names none) are counted apart, so that the
refinement can tell a step timed per micro-batch from one that is not. Without a current clock
both are the originals.

How a step is timed: on CUDA (``torch.cuda.is_initialized()`` when the clock is made) each timed
call records a CUDA event at its start and one at its end on the current stream, without any
synchronisation, so the host keeps queueing kernels ahead; :meth:`BusyClock.settle` reads them
once the step has run, after one synchronisation (its last event). A pair of events spans the
current stream's work between them, what that stream waits for included (other streams' work
it joins). On CPU the host's
``perf_counter`` times each call as it returns (CPU work has finished then). Cost per timed call:
two events (or two clock reads) and two dictionary operations.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_dcp.integration.patches.table import Patch


class BusyClock:
    """Seconds spent in the timed calls since the clock was made: in total, per micro-batch
    index, and those no micro-batch claimed. With ``events`` (CUDA) a call's seconds are known
    once :meth:`settle` has read its events; without, as soon as it returns."""

    def __init__(self, events: bool = False) -> None:
        self.events = events
        self.busy_s = 0.0
        self.unclaimed_s = 0.0
        self.microbatch_s: Dict[int, float] = {}
        self.current: Optional[int] = None  # the micro-batch whose forward step runs
        self.owners: Dict[int, int] = {}  # id(a forward step's output) -> its micro-batch
        self.unread: List[Tuple[Any, Any, Optional[int]]] = []  # (start, end event, micro-batch)

    def add(self, seconds: float, microbatch: Optional[int] = None) -> None:
        self.busy_s += seconds
        if microbatch is None:
            self.unclaimed_s += seconds
        else:
            self.microbatch_s[microbatch] = self.microbatch_s.get(microbatch, 0.0) + seconds

    def mark(self) -> Any:
        """This point of the work: a CUDA event recorded on the current stream (no
        synchronisation) with ``events``, else the host clock (:func:`now`)."""
        if not self.events:
            return now()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def close_span(self, start: Any, microbatch: Optional[int]) -> None:
        """The work from the mark ``start`` to now belongs to ``microbatch`` (None: unclaimed)."""
        end = self.mark()
        if self.events:
            self.unread.append((start, end, microbatch))
        else:
            self.add(end - start, microbatch)

    def settle(self) -> None:
        """Add the seconds of the recorded events: one synchronisation, on the last event
        recorded (every earlier one has then completed), then reads that do not wait."""
        if not self.unread:
            return
        self.unread[-1][1].synchronize()
        for start, end, microbatch in self.unread:
            self.add(start.elapsed_time(end) / 1e3, microbatch)
        self.unread = []

    def per_microbatch(self, count: int) -> List[float]:
        """``[unclaimed, micro-batch 0, …, micro-batch count−1]`` seconds (a claimed index
        outside the range counts as unclaimed), once the recorded events are read."""
        self.settle()
        outside = sum(s for i, s in self.microbatch_s.items() if not 0 <= i < count)
        return [self.unclaimed_s + outside] + [self.microbatch_s.get(i, 0.0) for i in range(count)]


class ClockSlot:
    """The clock the patched steps report to (None: not timing)."""

    clock: Optional[BusyClock] = None


SLOT = ClockSlot()


def now() -> float:
    """The host clock, ``time.perf_counter()``: what a call on CPU is timed with (no device
    work runs on after the call returns)."""
    return time.perf_counter()


@contextmanager
def timing_steps() -> Iterator[BusyClock]:
    """A clock of the steps run inside the block: the backward steps, and the forward step
    functions wrapped with :func:`timed` (0 where the patches are not applied). It times with
    CUDA events when CUDA is initialised, else with the host clock."""
    clock, previous = BusyClock(events=torch.cuda.is_initialized()), SLOT.clock
    SLOT.clock = clock
    try:
        yield clock
    finally:
        SLOT.clock = previous


def timed(function: Callable, clock: BusyClock) -> Callable:
    """``function`` adding the duration of each call to ``clock``, for the micro-batch current
    when it is called."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        microbatch, start = clock.current, clock.mark()
        try:
            return function(*args, **kwargs)
        finally:
            clock.close_span(start, microbatch)

    return call


def _announcing_forward_step(owner: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        clock = SLOT.clock
        if clock is None:
            return original(*args, **kwargs)
        clock.current = microbatch = kwargs.get("current_microbatch")
        try:
            result = original(*args, **kwargs)
        finally:
            clock.current = None
        if microbatch is not None:
            clock.owners[id(result[0])] = microbatch
        return result

    return forward_step


def _timed_backward_step(owner: Any, original: Callable) -> Callable:
    @functools.wraps(original)
    def backward_step(*args: Any, **kwargs: Any) -> Any:
        clock = SLOT.clock
        if clock is None:
            return original(*args, **kwargs)
        output = args[1] if len(args) > 1 else kwargs.get("output_tensor")
        microbatch, start = clock.owners.pop(id(output), None), clock.mark()
        try:
            return original(*args, **kwargs)
        finally:
            clock.close_span(start, microbatch)

    return backward_step


TIMING_PATCHES: Tuple[Patch, ...] = (
    Patch(
        "forward_step_microbatch",
        "dcp",
        ("megatron.core.pipeline_parallel.schedules:forward_step",),
        "megatron's forward step function is not told which micro-batch it runs; the online "
        "refinement of the cost model needs each micro-batch's busy seconds (it identifies the "
        "per-micro-batch cost from them), so the timed forward step and the backward step of "
        "its output are attributed to the forward step's current_microbatch.",
        _announcing_forward_step,
    ),
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
