"""Launch ``megatron_dcp.pretrain_gpt`` with torchrun and read back what it logged.

Used by the quick-start and the functional tests: each run is a real multi-process training job;
the per-iteration ``lm loss``, the ``[DCP]`` figures and megatron's parameter count are parsed
from its output.
:func:`start_agents` launches one torchrun agent per node meeting at a c10d rendezvous (the
multi-node launch of docs/scaling.md, here with every node on this machine). A
:class:`NodeLaunch` runs a node's torchrun under a command prefix (bench-train's ``--link-rate``:
inside a network namespace, ``tools.link``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([0-9.eE+-]+)")
DCP_LINE = re.compile(
    r"\[DCP\] iteration\s+(\d+) \| micro-batches: (\d+) \| CP sizes \(size:seqs\): ([\d: ]+) \| "
    r"plan time \(ms\): ([\d.]+) \| load imbalance est\.(?:/meas\.)?: ([\d.]+)(?:/([\d.]+))? \| "
    r"fwd-bwd time \(ms\) pred\.(?:/meas\.)?: ([\d.]+)(?:/([\d.]+))?(?: \| tokens/s: (\d+))?"
)

# megatron's count of the model's parameters on each (tensor, pipeline) rank, printed once per
# rank pair by data-parallel and context-parallel rank 0 (the middle rank, GPU weight
# rematerialisation, is 0 on these runs).
PARAMETERS = re.compile(
    r"number of parameters on \(tensor, \w+, pipeline\) model parallel rank "
    r"\((\d+), \d+, (\d+)\): (\d+)"
)


@dataclass(frozen=True)
class DCPFigures:
    """The ``[DCP]`` line of one iteration (the forward-backward times of the busiest position:
    predicted by the cost model that planned the step, and measured). The measured figures are
    None when the step was not timed (``--dcp-cost-adapt off`` without ``--dcp-time-steps on``)."""

    microbatches: int
    cp_sizes: Dict[int, int]
    plan_time_ms: float
    estimated_imbalance: float
    measured_imbalance: Optional[float]
    tokens_per_s: Optional[int]
    predicted_step_ms: float = 0.0
    measured_step_ms: Optional[float] = 0.0


@dataclass
class RunLog:
    """What a training run printed: losses and DCP figures by iteration, the model's parameters
    by (tensor rank, pipeline rank), and the whole output."""

    losses: Dict[int, float] = field(default_factory=dict)
    dcp: Dict[int, DCPFigures] = field(default_factory=dict)
    output: str = ""
    parameters: Dict[Tuple[int, int], int] = field(default_factory=dict)


def parse_log(text: str) -> RunLog:
    log = RunLog(output=text)
    for match in ITERATION.finditer(text):
        log.losses[int(match.group(1))] = float(match.group(2))
    for match in PARAMETERS.finditer(text):
        log.parameters[int(match.group(1)), int(match.group(2))] = int(match.group(3))
    for match in DCP_LINE.finditer(text):
        sizes = dict(tuple(map(int, pair.split(":"))) for pair in match.group(3).split())
        log.dcp[int(match.group(1))] = DCPFigures(
            int(match.group(2)),
            sizes,
            float(match.group(4)),
            float(match.group(5)),
            measured_figure(match.group(6), float),
            measured_figure(match.group(9), int),
            predicted_step_ms=float(match.group(7)),
            measured_step_ms=measured_figure(match.group(8), float),
        )
    return log


def measured_figure(text: Optional[str], kind: Callable[[str], Any]) -> Any:
    """A measured figure of the ``[DCP]`` line, None where the step was not timed."""
    return None if text is None else kind(text)


# A line that states an error: ``SomeError: ...``, ``Exception: ...`` (a traceback's last line),
# or argparse's ``prog: error: ...``; after the ``[rank3]:`` prefix torchrun adds.
ERROR_LINE = re.compile(
    r"^(?:\[(?:rank|default)\d+\]:\s*)?"
    r"((?:[\w.]+\.)?\w*(?:Error|Exception)(?::.*)?|\S.*?\berror: .*)$"
)
# torchrun's own summary of a failed rank: never the cause.
TORCHRUN_SUMMARY = "ChildFailedError"
TAIL_LINES = 40


class TrainingRunError(RuntimeError):
    """The training job exited with an error; the message holds the last error line of its
    output and the file that holds all of it (or, without either, the tail of its output)."""


def last_error_line(text: str) -> Optional[str]:
    """The last line of ``text`` that states an error (without torchrun's rank prefix), leaving
    out torchrun's summary; None when there is none."""
    for line in reversed(text.splitlines()):
        match = ERROR_LINE.match(line.strip())
        if match and TORCHRUN_SUMMARY not in line:
            return match.group(1).strip()
    return None


def failure_message(what: str, text: str, log_path: Optional[Path] = None) -> str:
    """Why a run failed: the last error line of its output and the log that holds all of it;
    the tail of the output when there is no such line or no log to read."""
    cause = last_error_line(text)
    tail = "\n".join(text.splitlines()[-TAIL_LINES:])
    if cause is None:
        where = f" (all of it in {log_path})" if log_path is not None else ""
        return f"{what}; the last {TAIL_LINES} lines of its output{where}:\n{tail}"
    if log_path is None:
        return f"{what}: {cause}\nthe last {TAIL_LINES} lines of its output:\n{tail}"
    return f"{what}: {cause}\n(the last error line of {log_path}, which holds the run's output)"


@dataclass(frozen=True)
class NodeLaunch:
    """How one node's torchrun is started: after a command ``prefix`` (which runs the rest of
    the line), with ``env`` added to :func:`worker_env`, ``torchrun_flags`` added to torchrun's,
    and ``preexec_fn`` run in the child before it executes."""

    prefix: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    torchrun_flags: Sequence[str] = ()
    preexec_fn: Optional[Callable[[], None]] = None


# How ``python`` starts torchrun.
TORCHRUN = ("-m", "torch.distributed.run")


def run_pretrain(
    args: Sequence[str],
    nproc: int,
    log_path: Optional[Path] = None,
    timeout_s: float = 900.0,
    port: Optional[int] = None,
    entry: str = "pretrain_gpt",
    launch: NodeLaunch = NodeLaunch(),
    on_line: Optional[Callable[[str], None]] = None,
    launcher: Sequence[str] = TORCHRUN,
) -> RunLog:
    """Run ``torchrun --standalone --nproc-per-node nproc -m megatron_dcp.<entry> args``
    (under ``launch``); ``on_line`` sees every line of its output as it comes (progress).
    ``launcher``: the python arguments that start the launcher, torchrun's by default (the
    functional tests fork their ranks instead: ``megatron_dcp.testing.forked_launch``)."""
    command = [*launch.prefix, sys.executable, *launcher]
    command += [f"--nproc-per-node={nproc}", *launch.torchrun_flags]
    command += ["--standalone"] if port is None else ["--master-port", str(port)]
    command += ["-m", f"megatron_dcp.{entry}", *args]
    process = subprocess.Popen(
        command,
        env={**worker_env(), **launch.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=launch.preexec_fn,
    )
    returncode, output = streamed(process, timeout_s, on_line)
    if log_path is not None:
        log_path.write_text(output)
    if returncode != 0:
        what = f"training exited with {returncode}"
        raise TrainingRunError(failure_message(what, output, log_path))
    return parse_log(output)


def streamed(
    process: subprocess.Popen, timeout_s: float, on_line: Optional[Callable[[str], None]]
) -> Tuple[int, str]:
    """``process``'s exit code and whole output, read line by line by a thread (each line to
    ``on_line`` too); past ``timeout_s`` it is killed and ``subprocess.TimeoutExpired`` raised
    with the output so far, as ``subprocess.run`` does."""
    lines: List[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line)

    reader = threading.Thread(target=read, name="run-output", daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        reader.join(timeout=5)
        raise subprocess.TimeoutExpired(process.args, timeout_s, output="".join(lines)) from None
    except BaseException:  # an interrupt: no run is left behind
        process.kill()
        process.wait()
        raise
    reader.join()
    return process.returncode, "".join(lines)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_rank_per_core(nproc: int, fix: str) -> None:
    """A ValueError naming ``--nproc`` when the ranks would outnumber the cores: ranks that
    share a core time each other, not the work. ``fix`` ends the message."""
    cores = available_cores()
    if nproc > cores:
        raise ValueError(
            f"--nproc={nproc}: this machine gives the process {cores} cores, and ranks that "
            f"share a core time each other. {fix.format(cores=cores)}"
        )


def worker_env() -> Dict[str, str]:
    """The environment of a training job: one thread per rank, warnings off."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def agent_command(
    args: Sequence[str],
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    run_id: str,
    entry: str = "pretrain_gpt",
    launch: NodeLaunch = NodeLaunch(),
) -> List[str]:
    """The torchrun line of one node's agent: ``nnodes`` agents of ``nproc_per_node`` ranks
    meet at the c10d rendezvous ``endpoint`` (host:port) under ``run_id``; ``launch``'s
    prefix and torchrun flags added."""
    return [
        *launch.prefix,
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        *launch.torchrun_flags,
        "-m",
        f"megatron_dcp.{entry}",
        *args,
    ]


@dataclass(frozen=True)
class Agents:
    """Where and how :func:`start_agents` starts a job's agents: the rendezvous ``host``, the
    module ``megatron_dcp.<entry>`` they train with, and one :class:`NodeLaunch` per node
    (none: every node plain)."""

    host: str = "127.0.0.1"
    entry: str = "pretrain_gpt"
    launches: Sequence[NodeLaunch] = ()

    def launch(self, node: int) -> NodeLaunch:
        return self.launches[node] if self.launches else NodeLaunch()


def start_agents(
    args: Sequence[str],
    nnodes: int,
    nproc_per_node: int,
    port: int,
    log_dir: Path,
    agents: Agents = Agents(),
) -> List[subprocess.Popen]:
    """Start ``nnodes`` agents on this machine (rendezvous at ``agents.host:port``, loopback
    by default), each writing ``agent<i>.log`` in ``log_dir``; each in a session of its own."""
    endpoint, started = f"{agents.host}:{port}", []
    for node in range(nnodes):
        launch = agents.launch(node)
        log = open(log_dir / f"agent{node}.log", "w")
        command = agent_command(
            args, nnodes, nproc_per_node, endpoint, f"dcp-{port}", agents.entry, launch
        )
        started.append(
            subprocess.Popen(
                command,
                env={**worker_env(), **launch.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=launch.preexec_fn,
            )
        )
        log.close()
    return started


def run_agents(
    args: Sequence[str],
    nnodes: int,
    nproc_per_node: int,
    port: int,
    log_dir: Path,
    timeout_s: float = 900.0,
    agents: Agents = Agents(),
    on_started: Optional[Callable[[List[subprocess.Popen]], None]] = None,
) -> RunLog:
    """Run a job as ``nnodes`` agents (:func:`start_agents`; ``on_started`` then gets their
    processes) and parse what all of them logged (megatron prints the loss on the last rank,
    wherever the rendezvous placed it)."""
    started = start_agents(args, nnodes, nproc_per_node, port, log_dir, agents)
    try:
        if on_started is not None:
            on_started(started)
        codes = [agent.wait(timeout=timeout_s) for agent in started]
    finally:
        for agent in started:
            if agent.poll() is None:
                kill_tree(agent.pid)
    logs = [log_dir / f"agent{i}.log" for i in range(nnodes)]
    texts = [log.read_text() for log in logs]
    if any(codes):
        stated = [i for i, text in enumerate(texts) if last_error_line(text)]
        first = (stated or [i for i, code in enumerate(codes) if code])[0]
        what = f"agents exited with {codes}"
        raise TrainingRunError(failure_message(what, texts[first], logs[first]))
    return parse_log("\n".join(texts))


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
