"""Stand-ins that run megatron-core 0.19.2 on a machine without CUDA (tests, CI, CPU runs).

They are installed by the patch table (``integration/patches/cpu_backend.py``, group ``cpu_backend``),
only when ``torch.cuda.is_available()`` is False; docs/cpu_backend.md explains each one:

* ``CudaToCpuMode``: rotary embeddings, the default causal mask, the pipeline schedules, p2p
  communication and the DDP buffers allocate with ``device="cuda"`` / ``.cuda()`` /
  ``.to("cuda")``; a global ``TorchFunctionMode`` rewrites those devices to the CPU. It also drops
  ``pin_memory=True`` / ``tensor.pin_memory()`` (non-packed CP RoPE slicing,
  ``get_pos_emb_on_this_cp_rank``), which raise without an accelerator.
* ``torch.cuda.current_device`` is used as a device argument in ~90 places: it answers ``"cpu"``.
* ``torch.cuda.synchronize`` / ``Stream`` / ``Event`` / ``current_stream`` / ``stream``: DDP's
  bucket bookkeeping and the schedules order work on CUDA streams; on CPU everything is already
  ordered, so they become no-op stand-ins.
* CUDA RNG: ``model_parallel_cuda_manual_seed`` and the rng tracker save, seed and restore the
  CUDA generator (``torch.cuda.get_rng_state`` and megatron's ``_get_cuda_rng_state`` /
  ``_set_cuda_rng_state``); they are routed to the CPU default generator.

``is_available`` itself is never faked (real megatron code paths switch on it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


def _to_cpu_device(value: Any) -> Any:
    return _CPU if _is_cuda_device(value) else value


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites cuda devices to cpu in every torch call: ``device=`` keyword arguments, device
    positional arguments (``tensor.to("cuda")``) and ``tensor.cuda()``; no pinned memory."""

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_cpu_device(kwargs["device"]))
        if func is torch.Tensor.to:
            args = tuple(_to_cpu_device(arg) for arg in args)
        return func(*args, **kwargs)


class DummyStream:
    """CUDA stream stand-in: CPU work is already ordered, so waiting and syncing are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def wait_stream(self, stream: Any) -> None:
        """No-op: one implicit CPU stream."""

    def wait_event(self, event: Any) -> None:
        """No-op: one implicit CPU stream."""

    def record_event(self, event: Any = None) -> "DummyEvent":
        return event if event is not None else DummyEvent()

    def synchronize(self) -> None:
        """No-op: CPU ops have finished when they return."""

    def query(self) -> bool:
        return True

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


class DummyEvent:
    """CUDA event stand-in (no timing on CPU: ``elapsed_time`` is 0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        """No-op."""

    def wait(self, stream: Any = None) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_DEFAULT_STREAM = DummyStream()


def current_stream(device: Any = None) -> DummyStream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def stream_context(stream: Any = None) -> Iterator[None]:
    yield


def cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def cpu_manual_seed(seed: int) -> None:
    # ``torch.manual_seed`` would call ``torch.cuda.manual_seed_all`` (patched) and recurse.
    torch.default_generator.manual_seed(int(seed))


def torch_cuda_stand_ins() -> dict[str, Any]:
    """``torch.cuda`` attribute -> its CPU stand-in."""
    return {
        "current_device": lambda: "cpu",
        "synchronize": lambda device=None: None,
        "Stream": DummyStream,
        "Event": DummyEvent,
        "current_stream": current_stream,
        "default_stream": current_stream,
        "stream": stream_context,
        "get_rng_state": cpu_rng_state,
        "set_rng_state": set_cpu_rng_state,
        "manual_seed": cpu_manual_seed,
        "manual_seed_all": cpu_manual_seed,
    }


def megatron_rng_stand_ins() -> dict[str, Any]:
    return {"_get_cuda_rng_state": cpu_rng_state, "_set_cuda_rng_state": set_cpu_rng_state}
