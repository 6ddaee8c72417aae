"""The host synchronisations and collectives of a DCP training step (docs/runtime.md, "What a
step costs the host"), counted on CPU with a fake CUDA and a stand-in for the GPU.

The fake CUDA: ``torch.cuda.is_initialized`` answers True, so the busy clock times with CUDA
events, and ``torch.cuda.Event`` is a stand-in that counts what is made of it;
``torch.cuda.synchronize``, every torch.distributed collective and megatron's pipeline shape
exchange (``P2PCommunicator._communicate_shapes``) are counted too.

The stand-in for the GPU (:class:`DeviceStandIn`): DCP's modules are told that the DP×CP and DP
groups communicate from ``cuda:0`` (what ``collective_device`` answers under NCCL), so DCP moves
its samples, lengths, digests and packed micro-batches there. Whatever is moved to (or made on)
``cuda`` becomes a :class:`DeviceTensor`, a CPU tensor that stands for a GPU one, and every
torch operation on one returns one (torch's subclass rule), so whatever DCP or megatron computes
from a micro-batch is on the "device" too. A read of a device tensor's values on the host
(``int()``, ``float()``, ``bool()``, ``operator.index``, ``.item()``, ``.tolist()``, ``.cpu()``,
``.to("cpu")``, ``.numpy()``) and a synchronous copy of a host tensor to the device (``.to`` /
``.cuda()`` without ``non_blocking``, ``torch.tensor(..., device="cuda")``) each make a GPU's
host wait for the stream: each is counted with the module that made it. (Samples routed from
other DP ranks arrive in host buffers here: with DP 1 nothing is routed.)

Counted per training step, by who made the call: megatron's forward-backward function (its
schedule, the patched forward and backward steps and DCP's forward step included), the
preparation of the global batch (length exchange, plan guard, routing, packing), and the rest of
the DCP schedule's call. The baseline is megatron's own step: the same DCP schedule with the two
timing entries of the patch table restored to megatron's functions and adaptation off. Then, on
the same batches:

- adaptation off: every count equals the baseline's, and the schedule adds nothing around
  megatron's function (no synchronisation, no host read, no collective);
- adaptation on (and adaptation off with ``time_steps``, the measuring tools' request): inside
  megatron's function only two recorded events per timed forward step function and backward
  step, nothing synchronised; after it one event synchronisation and one all-gather per group
  (DP×CP and, here, the pipeline), of host tensors (on a GPU over gloo twins of the groups,
  ``test_time_groups.py``: no second wait);
- in every phase, no device read and no synchronous copy per micro-batch by DCP's code, in the
  preparation or in the step: what remains is named in :data:`PREPARATION_READS` (once per
  global batch) and :data:`STEP_READS` (megatron's own and the CPU backend's attention);
- megatron's shape exchange is never called (the pipeline messages are sized from the plan:
  ``integration/patches/pipeline_shapes.py``), where with that entry of the patch table
  restored it runs before every pipeline message.

pp2·cp2 (world 4): the 1F1B schedule, whose megatron-core 0.19.2 batched p2p synchronises CUDA
itself (counted in the baseline), and the pipeline's gather of the times."""

import random
import sys
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.patches.pipeline_shapes import SHAPE_PATCHES  # noqa: E402
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
DP = 1  # the world is PP·CP
# Point-to-point sends and receives are counted where megatron batches them (batch_isend_irecv):
# torch's P2POp accepts only the very functions isend and irecv.
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
)  # fmt: skip
# The phases, run in this order on the same batches: (timing entries applied, cost_adapt,
# time_steps, pipeline shapes from the plan).
PHASES = {
    "megatron": (False, False, False, True),
    "adapt off": (True, False, False, True),
    "adapt on": (True, True, False, True),
    "tool timing": (True, False, True, True),
    "shapes exchanged": (True, False, False, False),
}
# Device reads and synchronous copies of one global batch's preparation, whatever its micro-batch
# count (each a collective's result, read where its group communicates from the GPU).
PREPARATION_READS = Counter(
    {
        # gather_lengths: the local lengths and their count go to the device (two synchronous
        # copies) and are checked for a negative one there (bool); the gathered counts (item,
        # one per DP rank) and lengths (tolist, one row per DP rank) are read back.
        "copy to device in megatron_dcp.runtime.exchange": 2,
        "bool in megatron_dcp.runtime.exchange": 1,
        "item in megatron_dcp.runtime.exchange": DP,
        "tolist in megatron_dcp.runtime.exchange": DP,
        # check_same_plan: the digest goes to the device; the all-reduced maximum and minimum
        # come back (two int).
        "copy to device in megatron_dcp.runtime.plan_guard": 1,
        "int in megatron_dcp.runtime.plan_guard": 2,
    }
)
# Who reads device tensors inside megatron's function, none of it DCP's own code (and the same in
# megatron's baseline).
ROPE = "megatron.core.models.common.embeddings.rope_utils"
REFERENCE_ATTENTION = "megatron_dcp.runtime.attention"
STEP_READS = {
    # megatron-core 0.19.2's unfused RoPE on THD (the CPU backend runs without RoPE fusion;
    # Transformer Engine's fused kernel takes cu_seqlens as they are): at every application,
    # queries and keys of each layer, the sequence lengths (tolist) and the total (item), and
    # one item per sequence when the frequencies cover the whole pack.
    ROPE: "tolist and item of cu_seqlens per RoPE application",
    # The CPU backend's reference attention, the stand-in for Transformer Engine's kernel (not
    # on a GPU): cu_seqlens and cu_seqlens_padded to the host once per layer.
    REFERENCE_ATTENTION: "cpu of the two cu_seqlens per layer",
}


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for one on the GPU (see the module docstring)."""


HOST_READS = {
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__index__: "index",
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}
SYNC_KINDS = {*HOST_READS.values(), "copy to device"}


def device_type(value: Any) -> Optional[str]:
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, str) and value.split(":")[0] in ("cuda", "cpu"):
        return value.split(":")[0]
    return None


def target_of(func: Callable, args: tuple, kwargs: dict) -> Optional[str]:
    """The device type a call moves to or makes its result on (None: it names none)."""
    if func is torch.Tensor.cuda:
        return "cuda"
    if func is torch.Tensor.to:
        named = [device_type(arg) for arg in (*args[1:], kwargs.get("device"))]
        return next((kind for kind in named if kind), None)
    return device_type(kwargs.get("device"))


def sync_of(func: Callable, args: tuple, kwargs: dict) -> Optional[str]:
    """What a call makes a GPU's host wait for: a read of a device tensor, a synchronous copy of
    a host tensor to the device; None for the rest."""
    on_device = bool(args) and isinstance(args[0], DeviceTensor)
    target = target_of(func, args, kwargs)
    if on_device and func in HOST_READS:
        return HOST_READS[func]
    if on_device and func is torch.Tensor.to and target == "cpu":
        return "cpu"
    moved = func in (torch.Tensor.to, torch.Tensor.cuda) and not on_device
    if moved and target == "cuda" and not kwargs.get("non_blocking", False):
        return "copy to device"
    if func in (torch.tensor, torch.as_tensor) and target == "cuda":
        return "copy to device"
    return None


def caller() -> str:
    """The megatron or megatron_dcp module whose code made the current torch call."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("megatron"):
            return module
        frame = frame.f_back
    return "the test"


class DeviceStandIn(TorchFunctionMode):
    """The GPU of this CPU run (module docstring): tags what moves to ``cuda``, counts reads."""

    def __init__(self, tally: "Tally") -> None:
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sync = sync_of(func, args, kwargs)
        if sync is not None:
            self.tally.count(f"{sync} in {caller()}")
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            return result
        if target_of(func, args, kwargs) == "cuda":
            return result if isinstance(result, DeviceTensor) else result.as_subclass(DeviceTensor)
        if sync == "cpu":
            return result.as_subclass(torch.Tensor)
        return result


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
    """CUDA initialised, its events and synchronisation counted, DCP's collectives on the
    stand-in device (a forked worker: the parent's torch is untouched)."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_dcp.integration import forward_backward
    from megatron_dcp.runtime import exchange, plan_guard

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
    for name in COLLECTIVES:
        setattr(dist, name, tally.counting(name, getattr(dist, name)))
    exchange_shapes = P2PCommunicator._communicate_shapes
    P2PCommunicator._communicate_shapes = tally.counting("shape exchange", exchange_shapes)
    for module in (forward_backward, exchange, plan_guard):
        module.collective_device = lambda group=None: torch.device("cuda", 0)
    DeviceStandIn(tally).__enter__()


def counted_phase(chunk: Any, batches: List[list], tally: Tally, phase: str) -> dict:
    """``STEPS`` training calls of a DCP schedule in ``phase``; per step the counts by scope
    and the plan."""
    patched, adapt, time_steps, planned = PHASES[phase]
    for patch in TIMING_PATCHES:
        (apply if patched else restore)(patch)
    for patch in SHAPE_PATCHES:
        (apply if planned else restore)(patch)
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


def device_reads(counts: Counter) -> Counter:
    """The reads of device tensors and synchronous copies to the device among ``counts``."""
    return Counter({key: n for key, n in counts.items() if key.split(" in ")[0] in SYNC_KINDS})


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
            # and of the pipeline, of host tensors: no device read.
            after = Counter({"event synchronize": 1, "all_gather": 2})
            assert scope(step, "dcp") == after, f"rank {rank}"
            assert scope(step, "preparation") == scope(own, "preparation"), f"rank {rank}"
        times = result[phase]["times"]
        assert times.per_microbatch and min(min(row) for row in times.microbatches) > 0


@pytest.mark.parametrize("phase", list(PHASES))
def test_the_preparation_reads_the_device_once_per_global_batch(counted, phase):
    """Whatever the micro-batch count (the steps plan 6 and 7), the preparation's device reads
    and synchronous copies are those of :data:`PREPARATION_READS`: none per micro-batch (the
    lengths, counts and layout of the packs are host integers, the packs reach the device by
    asynchronous copies)."""
    for rank, result in enumerate(counted):
        counts = [step["plan"].num_microbatches for step in result[phase]["steps"]]
        assert len(set(counts)) > 1, "the steps must differ in micro-batch count"
        for step in result[phase]["steps"]:
            reads = device_reads(scope(step, "preparation"))
            more, fewer = reads - PREPARATION_READS, PREPARATION_READS - reads
            assert not more and not fewer, f"rank {rank}: more {dict(more)}, fewer {dict(fewer)}"


@pytest.mark.parametrize("phase", list(PHASES))
def test_the_step_reads_no_device_tensor_of_dcps_own(counted, phase):
    """Inside megatron's function only megatron's own code and the CPU backend's attention read
    device tensors (:data:`STEP_READS`); the schedule around it reads none."""
    layers = OPTIONS.num_layers // PP
    for rank, result in enumerate(counted):
        for step in result[phase]["steps"]:
            reads = device_reads(scope(step, "megatron"))
            others = {key: n for key, n in reads.items() if key.split(" in ")[1] not in STEP_READS}
            assert not others, f"rank {rank}: device reads in the step {others}"
            twice_per_layer = 2 * layers * step["plan"].num_microbatches
            assert reads[f"tolist in {ROPE}"] == twice_per_layer, rank  # queries and keys
            assert reads[f"item in {ROPE}"] >= twice_per_layer, rank
            assert reads[f"cpu in {REFERENCE_ATTENTION}"] == twice_per_layer, rank  # both bounds
            assert device_reads(scope(step, "dcp")) == Counter(), f"rank {rank}"


def test_megatrons_shape_exchange_is_not_called_in_a_dcp_step(counted):
    """The pipeline messages of a DCP step are sized from its plan; with that entry of the patch
    table restored, megatron exchanges the shapes before each of them (one more batched p2p per
    p2p call; with CUDA also a synchronisation and a read), and nothing else changes."""
    for rank, result in enumerate(counted):
        planned, exchanged = result["adapt off"]["steps"], result["shapes exchanged"]["steps"]
        for own, step in zip(planned, exchanged):
            sized, asked = scope(own, "megatron"), scope(step, "megatron")
            assert "shape exchange" not in sized, f"rank {rank}: megatron exchanged shapes"
            calls = asked.pop("shape exchange", 0)
            assert calls > 0, f"rank {rank}: without the entry megatron must exchange shapes"
            assert asked["batch_isend_irecv"] == sized["batch_isend_irecv"] + calls
            asked["batch_isend_irecv"] = sized["batch_isend_irecv"]
            assert asked == sized, f"rank {rank}"
