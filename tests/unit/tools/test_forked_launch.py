"""``testing.forked_launch``: the functional tests' launcher gives each forked rank what torchrun
would give it, fails the job when one rank fails (stopping its peers), and leaves no rank behind
when it is killed itself. The ranks run a small module written here (no torch)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANK_MODULE = """
import os, sys, time

def main():
    rank = int(os.environ["RANK"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT")
    line = f"rank {rank} {__name__} {sys.argv[1:]} {[os.environ[key] for key in keys]}\\n"
    os.write(1, line.encode())  # one write: the ranks' lines do not interleave
    open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
    if sys.argv[2] == "fail" and rank == 1:
        raise RuntimeError("rank 1 fails")
    if sys.argv[2] in ("fail", "hang"):
        time.sleep(120)
    if sys.argv[2] == "worker":  # as a checkpoint writer does; stopped when the rank exits
        import multiprocessing
        worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
        worker.daemon = True
        worker.start()

if __name__ == "__main__":  # the launcher imports the module once before forking
    main()
"""


def launch(tmp_path: Path, nproc: int, mode: str) -> subprocess.Popen:
    (tmp_path / "rank_module.py").write_text(RANK_MODULE)
    command = [sys.executable, "-m", "megatron_dcp.testing.forked_launch"]
    command += [f"--nproc-per-node={nproc}", "--standalone", "-m", "rank_module"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    return subprocess.Popen(
        [*command, str(tmp_path), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split()[2] != "Z"


def rank_pids(tmp_path: Path, nproc: int, timeout_s: float = 30) -> list:
    deadline = time.monotonic() + timeout_s
    while not all((tmp_path / f"pid{rank}").exists() for rank in range(nproc)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    time.sleep(0.1)  # the file is written; its text follows
    return [int((tmp_path / f"pid{rank}").read_text()) for rank in range(nproc)]


def test_each_rank_gets_torchruns_variables_and_the_arguments(tmp_path):
    process = launch(tmp_path, 3, "ok")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    lines = sorted(line.split(" ", 3) for line in out.splitlines())
    assert [line[:3] for line in lines] == [["rank", str(r), "__main__"] for r in range(3)]
    variables = [eval(line[3].split("] ", 1)[1]) for line in lines]  # noqa: S307 - our output
    port = variables[0][6]
    assert variables == [[str(r), str(r), "3", "3", "0", "127.0.0.1", port] for r in range(3)]
    assert all(line[3].startswith(f"[{str(tmp_path)!r}, 'ok']") for line in lines)
    assert len(set(rank_pids(tmp_path, 3))) == 3


def test_a_failing_rank_fails_the_job_and_stops_its_peers(tmp_path):
    started = time.monotonic()
    process = launch(tmp_path, 3, "fail")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "RuntimeError: rank 1 fails" in err and "rank 1 exited with 1" in err
    assert time.monotonic() - started < 30, "the sleeping peers were not stopped"
    assert not any(alive(pid) for pid in rank_pids(tmp_path, 3))


def test_a_rank_exits_as_an_interpreter_stopping_the_workers_it_started(tmp_path):
    """A worker process a rank started would outlive it, holding the job's output open, if the
    rank skipped the interpreter's exit handlers."""
    process = launch(tmp_path, 2, "worker")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_launcher_leaves_no_rank_behind(tmp_path, how):
    process = launch(tmp_path, 2, "hang")
    pids = rank_pids(tmp_path, 2)
    process.send_signal(how)
    process.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)
