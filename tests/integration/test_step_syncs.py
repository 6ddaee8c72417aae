"""The host synchronisations and collectives of a DCP training step (docs/runtime.md, "What a
step costs the host"), counted on CPU with a fake CUDA: ``torch.cuda.is_initialized`` answers
True, so the busy clock times with CUDA events, and ``torch.cuda.Event`` is a stand-in that
counts what is made of it. Counted per training step, by who made the call: megatron's
forward-backward function (its schedule, the patched forward and backward steps included), the
preparation of the global batch (length exchange, plan guard, routing: not this budget), and
the rest of the DCP schedule's call. Counted: ``torch.cuda.synchronize``, CUDA events (made,
recorded, synchronised), ``Tensor.item`` / ``Tensor.tolist`` and every torch.distributed
collective.

The baseline is megatron's own step: the same DCP schedule with the two timing entries of the
patch table restored to megatron's functions and adaptation off. Then, on the same batches:

- adaptation off: every count equals the baseline's, and the schedule adds nothing around
  megatron's function (no synchronisation, no host read, no collective);
- adaptation on (and adaptation off with ``time_steps``, the measuring tools' request): inside
  megatron's function only two recorded events per timed forward step function and backward
  step, nothing synchronised; after it one event synchronisation, one all-gather per group
  (DP×CP and, here, the pipeline) and one read of the gathered times, a host tensor (on a GPU
  the gathers run over gloo twins of the groups, ``test_time_groups.py``: no second wait).

pp2·cp2 (world 4): the 1F1B schedule, whose megatron-core 0.19.2 batched p2p synchronises CUDA
itself (counted in the baseline), and the pipeline's gather of the times."""

import random
import time
from collections import Counter
from typing import Any, Callable, Dict, List

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.patches.step_timing import TIMING_PATCHES  # noqa: E402
from megatron_dcp.integration.patches.table import apply, restore  # noqa: E402
from megatron_dcp.integration.training.dcp_schedule import DCPSchedule  # noqa: E402
from megatron_dcp.integration.training.forward_step import forward_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    build_tiny_gpt,
    init_megatron,
    make_samples,
)

OPTIONS = TinyGPTOptions(num_layers=2)
STEPS, BATCH, BUDGET, PP, CP = 2, 8, 64, 2, 2
# Point-to-point sends and receives are counted where megatron batches them (batch_isend_irecv):
# torch's P2POp accepts only the very functions isend and irecv.
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
)  # fmt: skip
# The phases, run in this order on the same batches: (timing entries applied, cost_adapt,
# time_steps).
PHASES = {
    "megatron": (False, False, False),
    "adapt off": (True, False, False),
    "adapt on": (True, True, False),
    "tool timing": (True, False, True),
}


class Tally:
    """Counts of the calls made while ``scope`` is set, by scope and name."""

    def __init__(self) -> None:
        self.scope = None
        self.counts: Dict[str, Counter] = {}

    def count(self, name: str) -> None:
        if self.scope is not None:
            self.counts.setdefault(self.scope, Counter())[name] += 1

    def counting(self, name: str, function: Callable) -> Callable:
        """``function`` counted once per call: the CPU backend's torch function mode calls a
        tensor method again from inside it, and that inner call is not counted."""
        inside = [False]

        def call(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:
                return function(*args, **kwargs)
            self.count(name)
            inside[0] = True
            try:
                return function(*args, **kwargs)
            finally:
                inside[0] = False

        return call

    def scoped(self, scope: str, function: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            outer, self.scope = self.scope, scope
            try:
                return function(*args, **kwargs)
            finally:
                self.scope = outer

        return call


def fake_cuda(tally: Tally) -> None:
    """CUDA initialised, its events and synchronisation counted (a forked worker: the parent's
    torch is untouched)."""
    import torch
    import torch.distributed as dist

    class CountingEvent:
        def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
            tally.count("event made")
            self.at = None

        def record(self, stream: Any = None) -> None:
            tally.count("event recorded")
            self.at = time.perf_counter()

        def synchronize(self) -> None:
            tally.count("event synchronize")

        def elapsed_time(self, end: "CountingEvent") -> float:
            return (end.at - self.at) * 1e3

    torch.cuda.is_initialized = lambda: True
    torch.cuda.Event = CountingEvent
    torch.cuda.synchronize = tally.counting("cuda.synchronize", lambda device=None: None)
    for name in ("item", "tolist"):
        setattr(torch.Tensor, name, tally.counting(name, getattr(torch.Tensor, name)))
    for name in COLLECTIVES:
        setattr(dist, name, tally.counting(name, getattr(dist, name)))


def counted_phase(chunk: Any, batches: List[list], tally: Tally, phase: str) -> dict:
    """``STEPS`` training calls of a DCP schedule in ``phase``; per step the counts by scope
    and the plan."""
    patched, adapt, time_steps = PHASES[phase]
    for patch in TIMING_PATCHES:
        (apply if patched else restore)(patch)
    config = DCPConfig.for_model(
        chunk.config, BUDGET, vocab_size=OPTIONS.vocab_size, cost_adapt=adapt, time_steps=time_steps
    )
    schedule = DCPSchedule(config, lambda line: None)
    wrapper = schedule.build(chunk)
    wrapper.forward_backward_func = tally.scoped("megatron", wrapper.forward_backward_func)
    wrapper.prepare_from = tally.scoped("preparation", wrapper.prepare_from)
    call, steps = tally.scoped("dcp", schedule), []
    for samples in batches:
        tally.counts = {}
        call(forward_step_func=forward_step, data_iterator=iter(samples), model=chunk,
             num_microbatches=len(samples), forward_only=False)  # fmt: skip
        steps.append(dict(counts=tally.counts, plan=wrapper.plan))
    wrapper.groups.destroy()
    return dict(steps=steps, times=schedule.times)


def counting_run(rank: int, world_size: int, batches: List[list]) -> dict:
    init_megatron(1, PP, CP, seed=OPTIONS.seed)
    apply_patches()
    chunk = build_tiny_gpt(1, PP, CP, options=OPTIONS)[0]
    tally = Tally()
    fake_cuda(tally)
    return {phase: counted_phase(chunk, batches, tally, phase) for phase in PHASES}


def global_batches() -> List[list]:
    """Every rank holds the whole global batch (DP 1); lengths over 64 need a CP group of 2."""
    rng = random.Random(5)
    lengths = [[rng.randint(4, 120) for _ in range(BATCH)] for _ in range(STEPS)]
    return [make_samples(batch, OPTIONS.vocab_size, seed=s) for s, batch in enumerate(lengths)]


@pytest.fixture(scope="module")
def counted() -> List[dict]:
    return run_distributed(counting_run, PP * CP, global_batches(), timeout_s=300)


def scope(step: dict, name: str) -> Counter:
    return step["counts"].get(name, Counter())


def test_with_adaptation_off_the_step_is_megatrons_own(counted):
    for rank, result in enumerate(counted):
        for own, step in zip(result["megatron"]["steps"], result["adapt off"]["steps"]):
            assert step["plan"] == own["plan"], f"rank {rank}: the phases planned differently"
            assert scope(step, "megatron") == scope(own, "megatron"), f"rank {rank}"
            assert scope(step, "dcp") == Counter(), f"rank {rank}: the schedule added calls"
            assert scope(step, "preparation") == scope(own, "preparation"), f"rank {rank}"
        assert result["adapt off"]["times"] is None


@pytest.mark.parametrize("phase", ["adapt on", "tool timing"])
def test_a_timed_step_synchronises_once_after_megatrons_function(counted, phase):
    for rank, result in enumerate(counted):
        for own, step in zip(result["megatron"]["steps"], result[phase]["steps"]):
            assert step["plan"] == own["plan"], f"rank {rank}: the phases planned differently"
            # Inside megatron's function: one forward step function and one backward step per
            # micro-batch on each stage, two recorded events each, never synchronised.
            timed_calls = 2 * step["plan"].num_microbatches
            events = Counter({"event made": 2 * timed_calls, "event recorded": 2 * timed_calls})
            assert scope(step, "megatron") == scope(own, "megatron") + events, f"rank {rank}"
            # After it: one synchronisation (the last event), the gathers of the DP×CP domain
            # and of the pipeline, one read of the gathered times (host floats, over gloo).
            after = Counter({"event synchronize": 1, "all_gather": 2, "tolist": 1})
            assert scope(step, "dcp") == after, f"rank {rank}"
            assert scope(step, "preparation") == scope(own, "preparation"), f"rank {rank}"
        times = result[phase]["times"]
        assert times.per_microbatch and min(min(row) for row in times.microbatches) > 0
