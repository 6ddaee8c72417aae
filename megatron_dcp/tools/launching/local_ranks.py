"""Run one function on ``world_size`` fork-started workers joined by a gloo or NCCL process group.

Why fork: workers inherit the parent's imports (megatron takes 6-8 s to import; spawn would pay
that per rank). Why polling: a gloo failure aborts the worker (SIGABRT) instead of raising, and
its peers then block in the next collective until their timeout, so the parent watches every
child's exit code and tears the whole job down as soon as one dies, fails, or the deadline passes.

The backend is a parameter: gloo for the CPU tests, NCCL (one GPU per rank) for the GPU tests.
CUDA and fork: a process that has initialised CUDA cannot hand it to forked children, so the
parent must not touch CUDA. ``torch.cuda.is_available()`` initialises the driver (``cuInit``);
the harness asks ``torch.cuda.device_count()`` instead, which reads NVML and leaves CUDA alone.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
POLL_SECONDS = 0.02
# After a rank raises, how long to watch for a peer's death, the likelier root cause.
DEATH_GRACE_SECONDS = 1.0


class DistributedTestError(RuntimeError):
    """A worker raised, died, or the job ran past its deadline."""


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    world_size: int
    backend: str
    store_path: str
    collective_timeout_s: float
    args: tuple
    kwargs: dict


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Optional[str] = None,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank.

    ``backend``: ``"gloo"`` or ``"nccl"``; None picks NCCL when a CUDA GPU is visible, else gloo.
    With NCCL, rank ``r`` runs on GPU ``r % torch.cuda.device_count()``. Each worker has that
    default group (FileStore in a temp dir), one torch thread, and always tears down megatron's
    model-parallel state and the process group. Results travel back pickled (tensors included;
    move CUDA tensors to the CPU first). Raises ``ValueError`` before any worker starts on a bad
    argument, ``DistributedTestError`` with the failing rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = resolve_backend(backend)
    with tempfile.TemporaryDirectory(prefix="dcp_dist_") as tmp:
        store = os.path.join(tmp, "store")
        job = _Job(fn, world_size, backend, store, collective_timeout_s, args, kwargs)
        return _run_job(job, timeout_s)


def cuda_device_count() -> int:
    """Visible CUDA GPUs, without initialising CUDA in this process (NVML; module docstring)."""
    return torch.cuda.device_count()


def resolve_backend(backend: Optional[str]) -> str:
    """The process-group backend to use: ``backend`` checked, or the default for this machine.

    Checked here, in the parent, so that a wrong value is one clear error instead of every
    worker failing in ``init_process_group``.
    """
    if backend is None:
        return "nccl" if cuda_device_count() > 0 else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: run_distributed supports {BACKENDS}")
    if backend == "nccl":
        _check_nccl_usable()
    return backend


def _check_nccl_usable() -> None:
    """NCCL needs a GPU, a torch built with NCCL, and CUDA not yet initialised in the parent
    (forked workers could not use it: "Cannot re-initialize CUDA in forked subprocess")."""
    if cuda_device_count() == 0 or not dist.is_nccl_available():
        raise ValueError("backend='nccl' needs a CUDA GPU and a torch built with NCCL; use 'gloo'")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "backend='nccl': CUDA is already initialised in this process, so forked workers "
            "cannot use it; keep CUDA calls (torch.cuda.is_available() included) out of the "
            "parent and do the GPU work inside the workers"
        )


def _run_job(job: _Job, timeout_s: float) -> list[Any]:
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(job.world_size)]
    workers = [
        ctx.Process(target=_worker_main, args=(job, rank, pipes[rank][1]), daemon=True)
        for rank in range(job.world_size)
    ]
    for worker in workers:
        worker.start()
    for _, sender in pipes:
        sender.close()
    try:
        return _collect(workers, [receiver for receiver, _ in pipes], timeout_s)
    finally:
        _terminate(workers)


def _collect(workers: list, receivers: list[Connection], timeout_s: float) -> list[Any]:
    """Poll until every rank has reported, failing fast on the first error, death or timeout."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    while len(results) < len(workers):
        for rank, (worker, receiver) in enumerate(zip(workers, receivers)):
            if rank in results:
                continue
            try:
                reported, payload = _poll(rank, worker, receiver)
            except DistributedTestError as error:
                _raise_root_cause(workers, error)
            if reported:
                results[rank] = payload
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(workers))) - set(results))
            raise DistributedTestError(f"timed out after {timeout_s:.0f} s; ranks {missing} hang")
        time.sleep(POLL_SECONDS)
    return [results[rank] for rank in range(len(workers))]


def _poll(rank: int, worker: Any, receiver: Connection) -> tuple[bool, Any]:
    """``(True, result)`` once ``rank`` has reported, ``(False, None)`` while it runs; raises
    ``DistributedTestError`` when it raised or died (closed its pipe without a message)."""
    if receiver.poll():
        try:
            ok, payload = pickle.loads(receiver.recv_bytes())
        except EOFError:
            worker.join(timeout=5)
            raise _death(rank, worker) from None
        if not ok:
            raise DistributedTestError(f"rank {rank} raised:\n{payload}")
        return True, payload
    if worker.exitcode is not None:
        raise _death(rank, worker)
    return False, None


def _death(rank: int, worker: Any) -> DistributedTestError:
    return DistributedTestError(
        f"rank {rank} died with exit code {worker.exitcode} before reporting "
        "(a negative code is a signal: gloo aborts with SIGABRT)"
    )


def _raise_root_cause(workers: list, error: DistributedTestError) -> None:
    """A rank failed. When a peer died hard (a signal, not the harness's exit codes 0 and 1), that
    death is the likelier cause (gloo's "connection closed by peer" can reach a survivor first),
    so watch briefly for one and report it instead."""
    grace = time.monotonic() + DEATH_GRACE_SECONDS
    while time.monotonic() < grace:
        for rank, worker in enumerate(workers):
            if worker.exitcode not in (None, 0, 1):
                raise _death(rank, worker) from error
        time.sleep(POLL_SECONDS)
    raise error


def _terminate(workers: list) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.join(timeout=5)


def _worker_main(job: _Job, rank: int, sender: Connection) -> None:
    """Body of one worker: set up the process group, run the function, report, tear down, exit
    hard."""
    code = 0
    try:
        torch.set_num_threads(1)
        _init_process_group(job, rank)
        result = job.fn(rank, job.world_size, *job.args, **job.kwargs)
        message = (True, result)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        message = (False, traceback.format_exc())
        code = 1
    try:
        sender.send_bytes(pickle.dumps(message))
    except Exception:  # noqa: BLE001 - e.g. an unpicklable result
        sender.send_bytes(pickle.dumps((False, traceback.format_exc())))
        code = 1
    finally:
        _teardown()
        sender.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip atexit handlers inherited from the parent (pytest's among them)


def _init_process_group(job: _Job, rank: int) -> None:
    """Join the job's default group; with NCCL, first bind this rank to its GPU (NCCL takes the
    current device as the rank's device)."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if job.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(job.store_path, job.world_size)
    dist.init_process_group(
        job.backend,
        store=store,
        rank=rank,
        world_size=job.world_size,
        timeout=datetime.timedelta(seconds=job.collective_timeout_s),
    )


def _teardown() -> None:
    """Destroy megatron's model-parallel state (if megatron was used) and the process group."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    try:
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
