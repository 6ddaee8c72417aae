"""Launch ``megatron_dcp.pretrain_gpt`` with torchrun and read back what it logged.

Used by the quick-start and the functional tests: each run is a real multi-process training job;
the per-iteration ``lm loss`` and the ``[DCP]`` figures are parsed from its output.
"""

from __future__ import annotations

import os
import re
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
) -> RunLog:
    """Run ``torchrun --standalone --nproc-per-node nproc -m megatron_dcp.pretrain_gpt args``."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    command += ["--standalone"] if port is None else ["--master-port", str(port)]
    command += ["-m", "megatron_dcp.pretrain_gpt", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        command,
        env=env,
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


def flag_list(options: Dict[str, object]) -> List[str]:
    """``{"--seq-length": 512, "--dynamic-context-parallel": True}`` as command-line flags."""
    flags: List[str] = []
    for name, value in options.items():
        if value is True:
            flags.append(name)
        elif value is not False and value is not None:  # 0 is a value, not "off"
            flags += [name, str(value)]
    return flags
