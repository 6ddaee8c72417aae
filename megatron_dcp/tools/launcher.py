"""Launch ``megatron_dcp.pretrain_gpt`` with torchrun and read back what it logged.

Used by the quick-start and the functional tests: each run is a real multi-process training job;
the per-iteration ``lm loss`` and the ``[DCP]`` figures are parsed from its output.
:func:`start_agents` launches one torchrun agent per node meeting at a c10d rendezvous (the
multi-node launch of docs/scaling.md, here with every node on this machine).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.eE+-]+)")
DCP_LINE = re.compile(
    r"\[DCP\] iteration\s+(\d+) \| micro-batches: (\d+) \| CP sizes \(size:seqs\): ([\d: ]+) \| "
    r"plan time \(ms\): ([\d.]+) \| load imbalance est\./meas\.: ([\d.]+)/([\d.]+) \| "
    r"fwd-bwd time \(ms\) pred\./meas\.: ([\d.]+)/([\d.]+) \| tokens/s: (\d+)"
)


@dataclass(frozen=True)
class DCPFigures:
    """The ``[DCP]`` line of one iteration (the forward-backward times of the busiest position:
    predicted by the cost model that planned the step, and measured)."""

    microbatches: int
    cp_sizes: Dict[int, int]
    plan_time_ms: float
    estimated_imbalance: float
    measured_imbalance: float
    tokens_per_s: int
    predicted_step_ms: float = 0.0
    measured_step_ms: float = 0.0


@dataclass
class RunLog:
    """What a training run printed: losses and DCP figures by iteration, and the whole output."""

    losses: Dict[int, float] = field(default_factory=dict)
    dcp: Dict[int, DCPFigures] = field(default_factory=dict)
    output: str = ""


def parse_log(text: str) -> RunLog:
    log = RunLog(output=text)
    for match in ITERATION.finditer(text):
        log.losses[int(match.group(1))] = float(match.group(2))
    for match in DCP_LINE.finditer(text):
        sizes = dict(tuple(map(int, pair.split(":"))) for pair in match.group(3).split())
        log.dcp[int(match.group(1))] = DCPFigures(
            int(match.group(2)),
            sizes,
            float(match.group(4)),
            float(match.group(5)),
            float(match.group(6)),
            int(match.group(9)),
            predicted_step_ms=float(match.group(7)),
            measured_step_ms=float(match.group(8)),
        )
    return log


class TrainingRunError(RuntimeError):
    """The training job exited with an error; the message holds the tail of its output."""


def run_pretrain(
    args: Sequence[str],
    nproc: int,
    log_path: Optional[Path] = None,
    timeout_s: float = 900.0,
    port: Optional[int] = None,
    entry: str = "pretrain_gpt",
) -> RunLog:
    """Run ``torchrun --standalone --nproc-per-node nproc -m megatron_dcp.<entry> args``."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    command += ["--standalone"] if port is None else ["--master-port", str(port)]
    command += ["-m", f"megatron_dcp.{entry}", *args]
    done = subprocess.run(
        command,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if log_path is not None:
        log_path.write_text(done.stdout)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-40:])
        raise TrainingRunError(f"training exited with {done.returncode}:\n{tail}")
    return parse_log(done.stdout)


def worker_env() -> Dict[str, str]:
    """The environment of a training job: one thread per rank, warnings off."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def agent_command(
    args: Sequence[str], nnodes: int, nproc_per_node: int, endpoint: str, run_id: str
) -> List[str]:
    """The torchrun line of one node's agent: ``nnodes`` agents of ``nproc_per_node`` ranks
    meet at the c10d rendezvous ``endpoint`` (host:port) under ``run_id``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "-m",
        "megatron_dcp.pretrain_gpt",
        *args,
    ]


def start_agents(
    args: Sequence[str], nnodes: int, nproc_per_node: int, port: int, log_dir: Path
) -> List[subprocess.Popen]:
    """Start ``nnodes`` agents on this machine (loopback rendezvous on ``port``), each writing
    ``agent<i>.log`` in ``log_dir``; each in a session of its own."""
    endpoint, agents = f"127.0.0.1:{port}", []
    for node in range(nnodes):
        log = open(log_dir / f"agent{node}.log", "w")
        command = agent_command(args, nnodes, nproc_per_node, endpoint, f"dcp-{port}")
        agents.append(
            subprocess.Popen(
                command,
                env=worker_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()
    return agents


def run_agents(
    args: Sequence[str],
    nnodes: int,
    nproc_per_node: int,
    port: int,
    log_dir: Path,
    timeout_s: float = 900.0,
) -> RunLog:
    """Run a job as ``nnodes`` agents (:func:`start_agents`) and parse what all of them logged
    (megatron prints the loss on the last rank, wherever the rendezvous placed it)."""
    agents = start_agents(args, nnodes, nproc_per_node, port, log_dir)
    try:
        codes = [agent.wait(timeout=timeout_s) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent.pid)
    text = "\n".join((log_dir / f"agent{i}.log").read_text() for i in range(nnodes))
    if any(codes):
        tail = "\n".join(text.splitlines()[-40:])
        raise TrainingRunError(f"agents exited with {codes}:\n{tail}")
    return parse_log(text)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it at once (what a node failure looks like).
    torchrun starts its ranks in sessions of their own: killing only the agent, or its process
    group, leaves them running."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> List[int]:
    """Every process below ``pid``, from /proc (Linux)."""
    children: Dict[int, List[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def flag_list(options: Dict[str, object]) -> List[str]:
    """``{"--seq-length": 512, "--dynamic-context-parallel": True}`` as command-line flags."""
    flags: List[str] = []
    for name, value in options.items():
        if value is True:
            flags.append(name)
        elif value is not False and value is not None:  # 0 is a value, not "off"
            flags += [name, str(value)]
    return flags
