"""One run of the link-rate sweep, read back from its folder: what ``bench-train`` measured
(``bench_train.json``), what the model predicted (``plans.jsonl``) and the link it ran over.

A run's folder is named ``<workload>_<rate>[_<tag>]`` (``scripts/bench_links.sh``: the rate is
``unshaped`` or a tc rate such as ``300mbit``; the tag names a repeat or ``2nodes``). The link is
``bench_train.json``'s ``link`` object (``bench-train --link-rate``), else a ``link.json`` beside
it (the sweep's probe of an unshaped loopback), else none: an unshaped run, whose rate is
``machine.json``'s ``loopback_bytes_per_s`` when it has one (unknown otherwise).

The model's predicted speedup is Σ (``critical_path_s`` + r) of static / Σ of the arm over the
compared batches: the critical path is what the planner minimises and what the run's order score
compares (``predicted_s``, the busiest position's busy time, leaves out the waits between
micro-batches, which a step's wall time contains); ``r`` is the part of a step no plan changes
(:func:`step_remainder_s`: megatron's step time less the forward-backward, measured). The measured
speedup is of whole steps, so without ``r`` a prediction of the forward-backward alone would
overstate every gain by the share of the step that the gradient all-reduce (on the shaped link)
and the optimizer take.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from megatron_dcp.tools.bench_train.report import JSON_FILE
from megatron_dcp.tools.bench_train.stats import Interval
from megatron_dcp.tools.bench_train.worker import PLANS_FILE
from megatron_dcp.tools.progress import plain_line

UNSHAPED = "unshaped"
LINK_FILE = "link.json"
MACHINE_FILE = "machine.json"
TIMINGS_FILE = "timings.txt"  # "<run> <seconds> s", a line per finished run (bench_links.sh)
DEV = "megatron_dev"
ERROR_WINDOW = "5-30"


@dataclass(frozen=True)
class Link:
    """The link a run's ranks talked over (bytes/s; ``None`` where not known)."""

    rate: str  # tc's rate as requested, or "unshaped"
    requested_bytes_per_s: Optional[float]
    probed_bytes_per_s: Optional[float]
    nodes: int

    @property
    def bytes_per_s(self) -> Optional[float]:
        """The probed rate, else the requested one."""
        return self.probed_bytes_per_s or self.requested_bytes_per_s

    def per_rank(self, nproc: int) -> Optional[float]:
        """What one rank may send: on one shaped loopback every rank shares one token bucket
        (probed / nproc); across two nodes each veth end is shared by its node's ranks."""
        rate = self.bytes_per_s
        return None if rate is None else rate / (nproc / self.nodes)


@dataclass(frozen=True)
class SweepRun:
    name: str
    workload: str
    tag: str
    nproc: int
    oversubscribed: bool
    link: Link
    speedup: Dict[str, Interval]  # arm -> over static (measured)
    dcp_over_dev: Optional[Interval]
    predicted: Dict[str, float]  # arm -> the model's speedup over static
    model_error: Optional[float]  # median over iterations 5-30
    clear_agree: int
    clear_total: int
    distance: Dict[str, float]  # arm -> median measured fwd-bwd / lower bound
    remainder_s: float = 0.0  # the part of a step no plan changes (step_remainder_s)


def first_of(record: Dict[str, object], *keys: str) -> object:
    for key in keys:
        if record.get(key) is not None:
            return record[key]
    return None


def read_link(folder: Path, bench: Dict[str, object], rate: str, machine: Dict) -> Link:
    record = bench.get("link")
    if record is None and (folder / LINK_FILE).is_file():
        record = json.loads((folder / LINK_FILE).read_text())
    if record is None:
        loopback = machine.get("loopback_bytes_per_s") if rate == UNSHAPED else None
        return Link(rate, None, loopback, 1)
    requested = first_of(record, "requested_bytes_per_s", "requested_bps")
    probed = first_of(record, "probed_bytes_per_s", "probed_bps", "probed")
    return Link(
        str(first_of(record, "requested", "rate", "requested_rate") or rate),
        None if requested is None else float(requested),
        None if probed is None else float(probed),
        int(first_of(record, "nodes") or 1),
    )


def interval(record: Optional[Dict[str, float]]) -> Optional[Interval]:
    return None if record is None else Interval(record["value"], record["low"], record["high"])


def read_plans(folder: Path, bench: Dict[str, object]) -> Dict[int, Dict[str, Dict]]:
    """Every arm's plan figures per batch: ``plans.jsonl``, else the steps' copies."""
    path = folder / PLANS_FILE
    if path.is_file():
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {record["batch"]: record["arms"] for record in lines}
    plans: Dict[int, Dict[str, Dict]] = {}
    for step in bench["steps"]:
        plans.setdefault(step["batch"], {})[step["arm"]] = step["plan"]
    return plans


def step_remainder_s(bench: Dict[str, object]) -> float:
    """Seconds of a step that no plan changes: the median, over the compared steps of every arm,
    of megatron's step time less the busiest position's forward-backward busy time (the gradient
    all-reduce, the optimizer, the data loader); 0 when that is negative."""
    rests = [
        (step["step_ms"] - step["fwd_bwd_ms"]) / 1e3
        for step in bench["steps"]
        if step["batch"] >= bench["warmup"]
    ]
    return max(0.0, statistics.median(rests)) if rests else 0.0


def predicted_speedups(
    plans: Dict[int, Dict[str, Dict]], arms: List[str], warmup: int, remainder_s: float = 0.0
) -> Dict:
    batches = [b for b in sorted(plans) if b >= warmup and all(a in plans[b] for a in arms)]
    if not batches:
        return {}

    def total(arm: str) -> float:
        return sum(plans[b][arm]["critical_path_s"] + remainder_s for b in batches)

    return {arm: total("static") / total(arm) for arm in arms if arm != "static"}


def distances(bench: Dict[str, object], plans: Dict[int, Dict[str, Dict]]) -> Dict[str, float]:
    """Per arm: median over compared steps of measured busiest fwd-bwd over the lower bound."""
    ratios: Dict[str, List[float]] = {}
    for step in bench["steps"]:
        if step["batch"] < bench["warmup"]:
            continue
        bound = plans[step["batch"]][step["arm"]]["lower_bound_s"]
        ratios.setdefault(step["arm"], []).append(step["fwd_bwd_ms"] / 1e3 / bound)
    return {arm: statistics.median(values) for arm, values in ratios.items()}


def read_run(folder: Path, machine: Dict[str, object]) -> SweepRun:
    bench = json.loads((folder / JSON_FILE).read_text())
    workload, _, rest = folder.name.partition("_")
    rate, _, tag = rest.partition("_")
    plans = read_plans(folder, bench)
    remainder = step_remainder_s(bench)
    summaries = bench["summaries"]
    ordering = bench["ordering"]
    return SweepRun(
        name=folder.name,
        workload=workload,
        tag=tag,
        nproc=bench["nproc"],
        oversubscribed=bench["oversubscribed"],
        link=read_link(folder, bench, rate or UNSHAPED, machine),
        speedup={a: interval(s["speedup"]) for a, s in summaries.items() if s["speedup"]},
        dcp_over_dev=interval(bench["dcp_over"].get(DEV)),
        predicted=predicted_speedups(plans, list(bench["arms"]), bench["warmup"], remainder),
        remainder_s=remainder,
        model_error=bench["errors"].get(ERROR_WINDOW),
        clear_agree=ordering["clear_agree"],
        clear_total=ordering["clear_total"],
        distance=distances(bench, plans),
    )


def read_machine(folder: Path) -> Dict[str, object]:
    path = folder / MACHINE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def read_sweep(folder: Path) -> List[SweepRun]:
    """Every run under ``folder`` (any depth), ordered by workload, then slowest link last."""
    if not folder.is_dir():
        raise ValueError(f"link-sweep {folder}: no such folder; give the sweep's output folder "
                         "(scripts/bench_links.sh writes bench_out/links).")
    machine = read_machine(folder)
    runs = [read_run(path.parent, machine) for path in sorted(folder.rglob(JSON_FILE))]
    if not runs:
        raise ValueError(f"link-sweep {folder}: no {JSON_FILE} under it; run "
                         "scripts/bench_links.sh first, or give the folder it wrote.")
    return sorted(runs, key=lambda r: (r.workload, -(r.link.bytes_per_s or float("inf")), r.tag))


def sweep_progress(folder: Path, total: int) -> str:
    """The sweep's progress after a run: runs done of ``total``, their time and an estimate of
    what is left, from the time of each run in ``folder``'s :data:`TIMINGS_FILE` (the sweep's
    start, the corpus and the GEMM rate, is no run's time and counts in neither)."""
    path = folder / TIMINGS_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    seconds = [float(line.split()[-2]) for line in lines if line.strip()]
    return plain_line("bench_links.sh", len(seconds), total, "runs", sum(seconds))


def flops_per_byte(run: SweepRun, flops_per_s: Optional[float]) -> Optional[float]:
    """One rank's achieved FLOP/s over the bytes/s it may send over the link."""
    per_rank = run.link.per_rank(run.nproc)
    return None if flops_per_s is None or not per_rank else flops_per_s / per_rank
