"""Run megatron-core 0.19.2 on a machine without CUDA (tests, CI, functional runs on CPU).

Each shim names the megatron behaviour it corrects (see CPU_BACKEND.md, "What breaks on CPU"):

* ``_CudaToCpuMode``: rotary embeddings, the default causal mask, the pipeline schedules, p2p
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

Applied only when ``torch.cuda.is_available()`` is False; ``is_available`` itself is never faked
(real megatron code paths switch on it). ``disable_cpu_backend`` undoes everything (for tests).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from megatron_dcp.integration.megatron_import import import_megatron_core

_CPU = torch.device("cpu")


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


def _to_cpu_device(value: Any) -> Any:
    return _CPU if _is_cuda_device(value) else value


class _CudaToCpuMode(TorchFunctionMode):
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


class _DummyStream:
    """CUDA stream stand-in: CPU work is already ordered, so waiting and syncing are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def wait_stream(self, stream: Any) -> None:
        """No-op: one implicit CPU stream."""

    def wait_event(self, event: Any) -> None:
        """No-op: one implicit CPU stream."""

    def record_event(self, event: Any = None) -> "_DummyEvent":
        return event if event is not None else _DummyEvent()

    def synchronize(self) -> None:
        """No-op: CPU ops have finished when they return."""

    def query(self) -> bool:
        return True

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


class _DummyEvent:
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


_DEFAULT_STREAM = _DummyStream()


def _current_stream(device: Any = None) -> _DummyStream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def _stream_context(stream: Any = None) -> Iterator[None]:
    yield


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # ``torch.manual_seed`` would call ``torch.cuda.manual_seed_all`` (patched) and recurse.
    torch.default_generator.manual_seed(int(seed))


def _torch_cuda_patches() -> dict[str, Any]:
    return {
        "current_device": lambda: "cpu",
        "synchronize": lambda device=None: None,
        "Stream": _DummyStream,
        "Event": _DummyEvent,
        "current_stream": _current_stream,
        "default_stream": _current_stream,
        "stream": _stream_context,
        "get_rng_state": _cpu_rng_state,
        "set_rng_state": _set_cpu_rng_state,
        "manual_seed": _cpu_manual_seed,
        "manual_seed_all": _cpu_manual_seed,
    }


def _megatron_random_patches() -> dict[str, Any]:
    return {"_get_cuda_rng_state": _cpu_rng_state, "_set_cuda_rng_state": _set_cpu_rng_state}


class _Backend:
    """The active shims: the torch-function mode and the replaced attributes' originals."""

    def __init__(self) -> None:
        self.mode: Optional[_CudaToCpuMode] = None
        self.originals: list[tuple[Any, str, Any]] = []

    def patch(self, owner: Any, replacements: dict[str, Any]) -> None:
        for name, value in replacements.items():
            self.originals.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self.originals):
            setattr(owner, name, value)
        self.originals.clear()


_BACKEND = _Backend()


def cpu_backend_enabled() -> bool:
    """True while the CPU shims are active."""
    return _BACKEND.mode is not None


def enable_cpu_backend() -> bool:
    """Install the CPU shims (idempotent). Returns True when they are active, False when CUDA is
    available (nothing is changed then). Imports megatron.core (with its triton stand-in)."""
    if torch.cuda.is_available():
        return False
    if cpu_backend_enabled():
        return True
    if not import_megatron_core():
        raise ImportError("megatron.core is not importable; the CPU backend patches it")
    from megatron.core.tensor_parallel import random as megatron_random

    _BACKEND.patch(torch.cuda, _torch_cuda_patches())
    _BACKEND.patch(torch.cuda.random, {"get_rng_state": _cpu_rng_state})
    _BACKEND.patch(megatron_random, _megatron_random_patches())
    _BACKEND.mode = _CudaToCpuMode()
    _BACKEND.mode.__enter__()
    return True


def disable_cpu_backend() -> None:
    """Remove the CPU shims (idempotent). Must run on the thread that enabled them."""
    if _BACKEND.mode is None:
        return
    _BACKEND.mode.__exit__(None, None, None)
    _BACKEND.mode = None
    _BACKEND.restore()
