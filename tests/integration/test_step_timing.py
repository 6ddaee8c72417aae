"""The per-micro-batch busy clock of the patch table's timing entries
(``integration/patches/step_timing.py``), driven in the call orders of megatron's schedules with
stand-in steps and a fake clock (no megatron, no timing noise): every second lands on the
micro-batch whose forward or backward step spent it, whatever the order; a forward step that
names no micro-batch leaves its seconds unclaimed; outside a clock the steps are the originals;
timed with (stand-in) CUDA events, the same seconds land on the same micro-batches, read after
one synchronisation once the step has run.
The real schedules (no pipelining, 1F1B, interleaved) are covered by
``test_cost_refinement.py``."""

import pytest

from megatron_dcp.integration.patches import step_timing
from megatron_dcp.integration.patches.step_timing import timed, timing_steps

FORWARD_S, BACKWARD_S = 1.0, 10.0


@pytest.fixture
def fake_clock(monkeypatch):
    """``step_timing.now`` reads this clock; the stand-in steps advance it."""
    clock = {"t": 0.0}
    monkeypatch.setattr(step_timing, "now", lambda: clock["t"])
    return clock


def stand_ins(clock):
    """megatron's ``forward_step`` and ``backward_step`` (patched), and the forward step
    function a schedule is given; a micro-batch's forward costs ``FORWARD_S × (index + 1)``."""

    def forward_step_func(index):
        clock["t"] += FORWARD_S * (index + 1)

    def forward_step(func, index, current_microbatch=None):
        func(index)
        return [object()], 1  # megatron's ([output_tensor], num_tokens)

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        clock["t"] += BACKWARD_S
        return None

    forward = step_timing._announcing_forward_step(None, forward_step)
    backward = step_timing._timed_backward_step(None, backward_step)
    return forward, backward, forward_step_func


def run_order(fake_clock, order, chunks=1, name_microbatch=True):
    """Run forward (``"F"``) and backward (``"B"``) steps in ``order``, per model chunk, FIFO
    per chunk as megatron's schedules do; the clock."""
    forward, backward, func = stand_ins(fake_clock)
    with timing_steps() as clock:
        run_steps(clock, forward, backward, func, order, chunks, name_microbatch)
    return clock


def run_steps(clock, forward, backward, func, order, chunks, name_microbatch):
    """The steps of ``order`` (see :func:`run_order`) under ``clock``."""
    step = timed(func, clock)
    outputs = {c: [] for c in range(chunks)}
    counts = {c: 0 for c in range(chunks)}
    for kind, chunk in order:
        if kind == "F":
            index = counts[chunk]
            counts[chunk] += 1
            named = {"current_microbatch": index} if name_microbatch else {}
            output, _ = forward(step, index, **named)
            outputs[chunk].append(output)
        else:
            backward(None, outputs[chunk].pop(0), None, None)


def expected(microbatches, chunks=1):
    return [0.0] + [chunks * (FORWARD_S * (i + 1) + BACKWARD_S) for i in range(microbatches)]


def test_without_pipelining_each_micro_batch_gets_its_forward_and_backward(fake_clock):
    order = [("F", 0), ("B", 0)] * 3
    clock = run_order(fake_clock, order)
    assert clock.per_microbatch(3) == expected(3)
    assert clock.busy_s == sum(expected(3))


def test_one_f_one_b_order_is_attributed_by_the_forward_output(fake_clock):
    """Warm-up forwards, then one forward one backward, then the cool-down backwards."""
    order = [("F", 0), ("F", 0), ("F", 0), ("B", 0), ("F", 0), ("B", 0), ("B", 0), ("B", 0)]
    assert run_order(fake_clock, order).per_microbatch(4) == expected(4)


def test_interleaved_chunks_add_up_per_micro_batch(fake_clock):
    """VPP: two model chunks, each runs micro-batches 0..2 in order, interleaved."""
    order = [("F", 0), ("F", 0), ("F", 1), ("F", 1), ("B", 1), ("F", 0), ("B", 1), ("F", 1)]
    order += [("B", 0), ("B", 1), ("B", 0), ("B", 0)]
    assert run_order(fake_clock, order, chunks=2).per_microbatch(3) == expected(3, chunks=2)


def test_a_forward_step_that_names_no_micro_batch_leaves_its_seconds_unclaimed(fake_clock):
    clock = run_order(fake_clock, [("F", 0), ("B", 0)] * 2, name_microbatch=False)
    assert clock.per_microbatch(2) == [clock.busy_s, 0.0, 0.0] and clock.busy_s > 0


def test_outside_a_clock_the_steps_are_the_originals(fake_clock):
    forward, backward, func = stand_ins(fake_clock)
    output, tokens = forward(func, 0, current_microbatch=0)
    assert tokens == 1 and backward(None, output, None, None) is None
    assert step_timing.SLOT.clock is None


class StandInEvent:
    """A CUDA event that reads the fake clock when recorded and counts its synchronisations."""

    synchronised = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = StandInEvent.clock["t"]

    def synchronize(self):
        StandInEvent.synchronised += 1

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


def test_with_cuda_events_the_step_is_read_once_after_it_ran(fake_clock, monkeypatch):
    """1F1B order timed with events: nothing is read (or synchronised) while the steps run;
    reading the clock synchronises once and attributes as the host clock does."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    monkeypatch.setattr(StandInEvent, "clock", fake_clock, raising=False)
    monkeypatch.setattr(step_timing, "now", lambda: pytest.fail("the host clock was read"))
    order = [("F", 0), ("F", 0), ("F", 0), ("B", 0), ("F", 0), ("B", 0), ("B", 0), ("B", 0)]
    forward, backward, func = stand_ins(fake_clock)
    with timing_steps() as clock:
        run_steps(clock, forward, backward, func, order, 1, True)
    assert clock.events and clock.busy_s == 0.0 and StandInEvent.synchronised == 0
    assert clock.per_microbatch(4) == pytest.approx(expected(4))
    assert StandInEvent.synchronised == 1 and clock.busy_s == pytest.approx(sum(expected(4)))
    assert clock.per_microbatch(4) == pytest.approx(expected(4))  # read once: no second sync
    assert StandInEvent.synchronised == 1
