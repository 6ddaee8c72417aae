"""``python -m megatron_dcp.testing.forked_launch --nproc-per-node N --standalone [--preload
PRELOAD] -m MODULE ARGS``: a single-node training job launched as ``torchrun --standalone`` launches it, for the
functional tests, with the ranks forked from one process that has imported ``MODULE`` (and ``PRELOAD``) already.

Why: each rank that torchrun starts imports torch and megatron itself (about 6 s of CPU), so an
8-rank job on a 2-core machine spends about 25 s importing before its first step; forked ranks
share one import. What a rank sees is what torchrun gives it: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``MODULE``
run as ``__main__`` with ``ARGS`` as ``sys.argv[1:]``, every rank's output on this process's
standard output and error. Like torchrun, the job fails (exit 1) when one rank fails, and its
peers are stopped then; a rank also dies with this process (``PR_SET_PDEATHSIG``), so a killed
launcher leaves no rank behind. The real launcher stays tested where the launch itself is the
subject: the multi-node test (two torchrun agents), the quick-start and the training-run tests.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from typing import Dict, List, Sequence, Tuple

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0
POLL_S = 0.05


def split_command(argv: Sequence[str]) -> Tuple[argparse.Namespace, str, List[str]]:
    """The launcher's options, the module and the module's arguments (everything after ``-m
    MODULE`` belongs to the module, as with torchrun)."""
    if "-m" not in argv or argv.index("-m") == len(argv) - 1:
        raise SystemExit("forked_launch: give -m MODULE [ARGS...]")
    at = list(argv).index("-m")
    parser = argparse.ArgumentParser(prog="forked_launch")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("--master-port", type=int, default=None)
    parser.add_argument(
        "--preload", action="append", default=[], help="a module to import before forking"
    )
    options = parser.parse_args(argv[:at])
    return options, argv[at + 1], list(argv[at + 2 :])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> Dict[str, str]:
    """The variables torchrun sets for rank ``rank`` of a single-node job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_rank(rank: int, nproc: int, port: int, module: str, args: List[str]) -> int:
    """In the forked child: become rank ``rank`` and run ``module`` as ``__main__``; the exit
    status. The child then leaves :func:`main` and exits as an interpreter does (its exit
    handlers run: multiprocessing stops the workers the rank started, such as a checkpoint
    writer's, which would otherwise outlive it holding the job's output open)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.update(rank_env(rank, nproc, port))
    sys.argv[1:] = args  # argv[0] is set by runpy
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - a rank's failure is reported, then it exits 1
        traceback.print_exc()
        return 1
    return 0


def stop(pids: Sequence[int]) -> None:
    """SIGTERM ``pids``, then SIGKILL what is still running after the grace."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if os.waitpid(pid, os.WNOHANG) == (0, 0)}
        time.sleep(POLL_S)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def wait_ranks(children: Dict[int, int]) -> int:
    """Wait for every rank; on the first failure stop the others. 0, or 1 when one failed."""
    running = dict(children)
    while running:
        pid, status = os.wait()
        rank = running.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"forked_launch: rank {rank} exited with {code}", file=sys.stderr, flush=True)
            stop(list(running))
            return 1
    return 0


def main(argv: Sequence[str]) -> int:
    options, module, args = split_command(argv)
    for name in (*options.preload, module):  # torch, megatron, the entry: once, for every rank
        importlib.import_module(name)
    port = options.master_port or free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children: Dict[int, int] = {}
    for rank in range(options.nproc_per_node):
        pid = os.fork()
        if pid == 0:  # the rank returns from here and exits
            return run_rank(rank, options.nproc_per_node, port, module, args)
        children[pid] = rank
    signal.signal(signal.SIGTERM, lambda *_: (stop(list(children)), sys.exit(143)))
    return wait_ranks(children)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
