"""The fork harness: results by rank, errors carry the traceback, dead workers and hangs fail fast
instead of blocking the test session; the backend is a checked parameter."""

import faulthandler
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.testing import DistributedTestError, run_distributed
from megatron_dcp.tools.launching.local_ranks import cuda_device_count


def _all_reduce_rank(rank, world_size):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return rank, world_size, value.item()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_by_rank(world_size):
    results = run_distributed(_all_reduce_rank, world_size)
    total = sum(range(world_size))
    assert results == [(rank, world_size, total) for rank in range(world_size)]


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def test_exception_reports_rank_and_traceback():
    with pytest.raises(DistributedTestError, match="rank 1 raised(.|\n)*boom from rank one"):
        run_distributed(_raise_on_rank_one, 2, timeout_s=60)


def _abort_quietly() -> None:
    """SIGABRT, as gloo does on a transport failure, without the "Fatal Python error" traceback
    faulthandler would print into the suite's output (this abort is on purpose)."""
    faulthandler.disable()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.abort()


def _abort_rank_zero_then_collective(rank, world_size):
    if rank == 0:
        _abort_quietly()
    dist.barrier()


def test_dead_worker_is_detected_while_peers_block():
    with pytest.raises(DistributedTestError, match="rank 0 died"):
        run_distributed(_abort_rank_zero_then_collective, 2, timeout_s=60)


def _rank_zero_never_joins(rank, world_size):
    if rank == 0:
        time.sleep(60)  # stuck outside the collective its peer waits in
    dist.barrier()


def test_hang_hits_the_deadline():
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_rank_zero_never_joins, 2, timeout_s=3, collective_timeout_s=30)


def _backend_and_sum(rank, world_size):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return dist.get_backend(), value.item()


def test_explicit_gloo_backend():
    assert run_distributed(_backend_and_sum, 2, backend="gloo") == [("gloo", 1.0)] * 2


def _no_worker(*args, **kwargs):
    raise AssertionError("a worker process was about to start")


@pytest.mark.parametrize("backend", ["mpi", "cuda", ""])
def test_unknown_backend_fails_before_any_worker_starts(backend, monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_context", _no_worker)
    with pytest.raises(ValueError, match=f"unknown backend {backend!r}.*'gloo', 'nccl'"):
        run_distributed(_all_reduce_rank, 2, backend=backend)


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the error on a machine without GPUs")
def test_nccl_without_gpu_fails_before_any_worker_starts(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_context", _no_worker)
    with pytest.raises(ValueError, match="backend='nccl' needs a CUDA GPU"):
        run_distributed(_all_reduce_rank, 2, backend="nccl")
