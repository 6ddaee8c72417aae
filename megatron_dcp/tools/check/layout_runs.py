"""One layout of ``megatron-dcp check``: a ``bench-train`` run (``bench_train.run.run_bench``, the
launcher bench-train uses) of the check's arms by the check's worker, then the reference arm
(``tools.check.reference_arm``, its own process) on what the workers trained on, and what both
found: the CP sizes every arm planned, static CP's and DCP's distance from the reference and
DCP's from static CP, per batch, loss and every gradient, and the step times."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_dcp.tools.bench_train.results import BenchResult, read_plans
from megatron_dcp.tools.check.reordered import CHECK_ARMS, REORDERED
from megatron_dcp.tools.check.stages import Stage
from megatron_dcp.tools.check.tolerance import Difference

WORKER = "tools.check.gradient_worker"
REFERENCE_ARM = "megatron_dcp.tools.check.reference_arm"
RANKS_DIR = "check"  # the workers' findings, rank<r>.jsonl
BATCHES, WARMUP = 3, 1  # the smoke figure compares the last two


@dataclass(frozen=True)
class Layout:
    """The parallel layout of one check run: pipeline stages × a DP 1 × CP ``cp`` domain."""

    pp: int
    cp: int

    @property
    def nproc(self) -> int:
        return self.pp * self.cp

    def flags(self) -> List[str]:
        pp, cp = str(self.pp), str(self.cp)
        return ["--pipeline-model-parallel-size", pp, "--context-parallel-size", cp]

    def __str__(self) -> str:
        return f"pp{self.pp}·cp{self.cp}" if self.pp > 1 else f"cp{self.cp}"


@dataclass
class LayoutResult:
    """What one layout's run found (``error``: why it did not finish)."""

    layout: Layout
    cp_sizes: Dict[str, List[List[int]]] = field(default_factory=dict)  # arm -> sizes per batch
    loss: List[Difference] = field(default_factory=list)
    gradients: List[Difference] = field(default_factory=list)
    tokens: Dict[str, List[int]] = field(default_factory=dict)  # arm -> tokens per batch
    speed: Optional[Dict[str, float]] = None
    error: Optional[str] = None
    training_flags: List[str] = field(default_factory=list)  # what the workers were started with
    reference: List[Difference] = field(default_factory=list)  # static and DCP against it
    reference_tokens: List[str] = field(default_factory=list)  # token counts that differ from it
    reference_error: Optional[str] = None  # why the reference arm did not finish
    stage: str = ""  # the precision stage's label ("" when the check has one stage)
    low_precision: bool = False  # bf16/fp16: undecidable quantities go to the float32 stage

    @property
    def where(self) -> str:
        """How the report names this run: the layout, after the stage when there are two."""
        return f"{self.stage} {self.layout}" if self.stage else str(self.layout)

    def undecided(self) -> List[Difference]:
        """The reference comparisons whose tolerance is over the ceiling."""
        return [d for d in self.reference if not d.decidable]

    def decides(self, difference: Difference) -> bool:
        """This stage decides ``difference``: float32 decides every one (one over the ceiling
        fails); a low-precision stage only those under it, the rest go to float32."""
        return difference.decidable or not self.low_precision

    def decided(self) -> List[Difference]:
        """The reference comparisons this stage decides (:meth:`decides`)."""
        return [d for d in self.reference if self.decides(d)]

    def mixes(self) -> bool:
        """DCP planned at least one batch on two or more CP sizes."""
        return any(len(sizes) > 1 for sizes in self.cp_sizes.get("dcp", []))

    def static_sizes(self) -> List[int]:
        arms = ("static", REORDERED)
        return sorted({s for arm in arms for batch in self.cp_sizes.get(arm, []) for s in batch})


def layouts_for(nproc: int) -> List[Layout]:
    """The DCP domain of every rank, and with 4 or more ranks (an even count) also two pipeline
    stages over half of them: the smallest domain with a mix of CP sizes has 2 ranks (groups of
    1 beside groups of 2), so a pipeline layout needs 4."""
    layouts = [Layout(1, nproc)]
    if nproc >= 4 and nproc % 2 == 0:
        layouts.append(Layout(2, nproc // 2))
    return layouts


def run_layout(layout: Layout, stage: Stage, out: Path, timeout_s: float) -> LayoutResult:
    """Run the check's arms on ``layout`` with the ``stage``'s training flags, then the
    reference arm; raises TrainingRunError when training fails."""
    from megatron_dcp.tools.check import reference_records
    from megatron_dcp.tools.bench_train.run import run_bench

    options = argparse.Namespace(out=out, nproc=layout.nproc, batches=BATCHES, warmup=WARMUP)
    options.entry = "pretrain_gpt"
    (out / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    for stale in (out / RANKS_DIR).glob("rank*.jsonl"):
        stale.unlink()
    reference_records.clear(out)
    bench = run_bench(
        options, CHECK_ARMS, [*stage.flags, *layout.flags()], worker=WORKER, timeout_s=timeout_s
    )
    result = read_result(layout, out, bench)
    result.stage, result.low_precision = stage.label, stage.low_precision
    add_reference(result, out, stage.precision, timeout_s)
    return result


def add_reference(result: LayoutResult, out: Path, precision: str, timeout_s: float) -> None:
    """Run the reference arm in a fresh interpreter that sees no GPU, and read its findings."""
    from megatron_dcp.tools.check import reference_records

    command = [sys.executable, "-m", REFERENCE_ARM, "--out", str(out), "--precision", precision]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        result.reference_error = f"the reference arm ran past {timeout_s:.0f} s"
        return
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        result.reference_error = f"the reference arm failed: {tail[0]}"
        return
    findings = json.loads(reference_records.findings_path(out).read_text())
    for found in findings:
        where = f"batch {found['batch']} {found['arm']} rank{found['rank']} {found['name']}"
        result.reference.append(
            Difference(where, found["magnitude"], found["rounding"], found["difference"],
                       runs=1, eps=found["eps"])  # fmt: skip
        )
        tokens = found.get("tokens")
        if tokens and tokens[0] != tokens[1]:
            mismatch = f"{where}: {tokens[0]} tokens, the reference {tokens[1]}"
            result.reference_tokens.append(mismatch)


def read_result(layout: Layout, out: Path, bench: BenchResult) -> LayoutResult:
    result = LayoutResult(layout, speed=speed_of(bench), training_flags=list(bench.flags))
    plans = read_plans(out)
    for arm in CHECK_ARMS:
        result.cp_sizes[arm] = [sorted(map(int, plans[b][arm]["cp_sizes"])) for b in sorted(plans)]
    for path in sorted((out / RANKS_DIR).glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        for record in records:
            add_record(result, path.stem, record, first_rank=path.stem == "rank0")
    return result


def add_record(result: LayoutResult, rank: str, record: dict, first_rank: bool) -> None:
    """One rank's line of one batch: its gradient differences; from rank 0 also the loss."""
    batch = record["batch"]
    for name, magnitude, noise, difference in record["tensors"]:
        where = f"batch {batch} {rank} {name}"
        result.gradients.append(Difference(where, magnitude, noise, difference))
    if not first_rank:
        return
    loss = record["loss"]
    for arm, (_, tokens) in loss.items():
        result.tokens.setdefault(arm, []).append(int(tokens))
    static = loss["static"][0]
    result.loss.append(
        Difference(
            f"batch {batch} loss",
            abs(static),
            abs(loss[REORDERED][0] - static),
            abs(loss["dcp"][0] - static),
        )
    )


def speed_of(bench: BenchResult) -> Dict[str, float]:
    """The smoke figure: DCP's and static CP's median step time, DCP's paired speedup and its
    tokens per second, over the batches after the warm-up."""
    static, dcp = bench.summaries["static"], bench.summaries["dcp"]
    return {
        "static_step_ms": static.step_ms.value,
        "dcp_step_ms": dcp.step_ms.value,
        "dcp_speedup": dcp.speedup.value if dcp.speedup else 1.0,
        "dcp_tokens_per_s": dcp.tokens_per_s,
        "static_tokens_per_s": static.tokens_per_s,
        "batches": float(BATCHES - WARMUP),
        "oversubscribed": float(bench.oversubscribed),
    }
