"""Planning off the critical path: the next global batch is read, its lengths exchanged, planned
and routed in a background thread while the current one trains.

:class:`Prefetcher` runs one ``prepare(iterator, count, comm)`` at a time on a daemon thread and
hands its result to the next call that asks for the same iterator and sample count (a call with
another iterator, e.g. an evaluation, leaves it waiting). Its collectives run on :class:`Comm`
communicators of their own (duplicates of the DP and DP×CP groups), so they never interleave
with the model's or with a synchronous preparation on the main thread. Every rank starts the
same preparations in the same order, so the background collectives always complete; ``close``
joins the thread (at the end of training, or when a step raises).

With CUDA the thread works on a CUDA stream of its own (its host-to-device copies, from pinned
memory, overlap the model's kernels); the result is handed over by making the consumer's
current stream wait for that work (``take``). The caller marks the handed-over tensors as used
on its stream (``Tensor.record_stream``) before the next preparation may reuse their memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

import torch
import torch.distributed as dist

from megatron_dcp.runtime.groups import default_group_timeout

Result = TypeVar("Result")


@dataclass(frozen=True)
class Comm:
    """The groups one preparation communicates over: the DP group (lengths, MTP token counts)
    and the DP×CP group (plan guard, routing)."""

    dp_group: Any
    domain_group: Any


def duplicate_group(group: Any) -> Any:
    """A new communicator over the ranks of ``group``. Collective over the whole world: every
    rank creates every group of this kind (one per distinct rank list), in the same order."""
    mine = tuple(dist.get_process_group_ranks(group))
    lists: list = [None] * dist.get_world_size()
    dist.all_gather_object(lists, mine)
    duplicate = None
    for ranks in sorted(set(lists)):
        created = dist.new_group(list(ranks), timeout=default_group_timeout())
        if ranks == mine:
            duplicate = created
    return duplicate


def dedicated_comm(comm: Comm) -> Comm:
    """Duplicates of ``comm``'s groups for the background thread (collective over the world)."""
    return Comm(duplicate_group(comm.dp_group), duplicate_group(comm.domain_group))


@dataclass
class _Job(Generic[Result]):
    iterator: Iterator[Any]
    count: int
    thread: threading.Thread
    result: Optional[Result] = None
    error: Optional[BaseException] = None
    done: Any = None  # a CUDA event recorded after the work, when on CUDA


class Prefetcher(Generic[Result]):
    """One background preparation at a time (module docstring)."""

    def __init__(self, prepare: Callable[[Iterator[Any], int, Comm], Result], comm: Comm):
        self.prepare, self.comm = prepare, comm
        self.job: Optional[_Job[Result]] = None
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def start(self, iterator: Iterator[Any], count: int) -> None:
        """Prepare the next ``count`` samples of ``iterator`` in the background."""
        self.close()
        thread = threading.Thread(target=self._run, name="dcp-prefetch", daemon=True)
        self.job = _Job(iterator, count, thread)
        thread.start()

    def take(self, iterator: Iterator[Any], count: int) -> Optional[Result]:
        """The preparation of ``iterator``'s next ``count`` samples when one was started (its
        error re-raised here), else None (a preparation for another iterator keeps waiting)."""
        job = self.job
        if job is None or job.iterator is not iterator or job.count != count:
            return None
        job.thread.join()
        self.job = None
        if job.error is not None:
            raise job.error
        if job.done is not None:
            torch.cuda.current_stream().wait_event(job.done)
        return job.result

    def close(self) -> None:
        """Wait for the running preparation, if any, and drop it (its error too)."""
        if self.job is not None:
            self.job.thread.join()
            self.job = None

    def _run(self) -> None:
        job = self.job
        assert job is not None
        try:
            if self.stream is None:
                job.result = self.prepare(job.iterator, job.count, self.comm)
                return
            with torch.cuda.stream(self.stream):
                job.result = self.prepare(job.iterator, job.count, self.comm)
                job.done = torch.cuda.Event()
                job.done.record(self.stream)
        except BaseException as error:  # handed to the main thread by take()
            job.error = error
