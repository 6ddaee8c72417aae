"""``megatron-dcp benchmark``: the reference workloads under each cost model, then the plan time
of every scheduler at N=64 and N=1024."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from megatron_dcp.integration.data.lengths import sample_lengths
from megatron_dcp.scheduling import CostModel, build_cost_model
from megatron_dcp.scheduling.cost import COST_MODELS
from megatron_dcp.tools.compare import (
    DEV_PEER_ALIAS,
    PEER_ALIAS,
    Comparison,
    DomainSpec,
    evaluate,
    format_comparison,
    render_table,
    run_scheduler,
)
from megatron_dcp.tools.workloads import REFERENCE_WORKLOADS, parse_distribution, reference_workload

BENCHMARK_SCHEDULERS = ("default_dynamic_cp", "dp_balanced", DEV_PEER_ALIAS, PEER_ALIAS)
# The dev peer is a reading of the published algorithm written for clarity, not speed: its plan
# time says nothing about upstream's, so the plan-time table leaves it out.
TIMED_SCHEDULERS = ("default_dynamic_cp", "dp_balanced", PEER_ALIAS)
# (dp, cp, sequences) of the plan-time runs; the last one is skipped by --quick.
TIMING_LAYOUTS = ((16, 4, 1024), (256, 4, 16384))
TIMING_REPEATS = 3


def benchmark_comparisons(args: argparse.Namespace) -> List[Comparison]:
    """Every selected reference workload under every selected cost model, printed as it goes."""
    workloads = (
        [reference_workload(w) for w in args.workload] if args.workload else REFERENCE_WORKLOADS
    )
    comparisons = []
    for cost_name in args.cost_model or list(COST_MODELS):
        for workload in workloads:
            spec = DomainSpec(workload.dp_size, workload.cp_size, workload.budget)
            title = f"{workload.name}: {workload.description}"
            lengths = workload.lengths(args.seed)
            comparison = evaluate(title, lengths, spec, cost_name, BENCHMARK_SCHEDULERS)
            comparisons.append(comparison)
            if not args.json:
                print(format_comparison(comparison) + "\n", flush=True)
    return comparisons


@dataclass(frozen=True)
class Timing:
    """Median plan time of one scheduler at one domain size (or why it has none)."""

    domain_size: int
    layout: str
    num_sequences: int
    budget: int
    scheduler: str
    median_ms: Optional[float]
    note: str = ""


def timing_lengths(count: int, dp: int, cp: int, seed: int) -> Tuple[List[int], int]:
    """Workload-1-like lengths and the budget that makes them ≈ 8 × N × budget tokens, raised to
    max length / cp where needed so that static CP (dp_balanced) can hold every sequence."""
    lengths = sample_lengths(parse_distribution(REFERENCE_WORKLOADS[0].distribution), seed, count)
    budget = math.ceil(sum(lengths) / (8 * dp * cp))
    return lengths, max(budget, math.ceil(max(lengths) / cp))


def time_scheduler(name: str, lengths: List[int], spec: DomainSpec, cost: CostModel) -> Timing:
    """Median of :data:`TIMING_REPEATS` plan times (the first failure makes it n/a)."""
    n = spec.dp_size * spec.cp_size
    desc = f"dp {spec.dp_size} × cp {spec.cp_size}"
    results = [run_scheduler(name, lengths, spec, cost) for _ in range(TIMING_REPEATS)]
    failed = [result for result in results if result.report is None]
    scheduler = results[0].scheduler
    if failed:
        return Timing(n, desc, len(lengths), spec.budget, scheduler, None, failed[0].note)
    median = statistics.median(result.report.plan_time_s * 1e3 for result in results)
    return Timing(n, desc, len(lengths), spec.budget, scheduler, median)


def benchmark_timings(args: argparse.Namespace) -> List[Timing]:
    """Plan time at N=64 (and N=1024 unless --quick), median of 3 runs."""
    cost = build_cost_model("model")
    timings = []
    for dp, cp, count in TIMING_LAYOUTS[:1] if args.quick else TIMING_LAYOUTS:
        lengths, budget = timing_lengths(count, dp, cp, args.seed)
        for name in TIMED_SCHEDULERS:
            timings.append(time_scheduler(name, lengths, DomainSpec(dp, cp, budget), cost))
    return timings


def format_timings(timings: Sequence[Timing]) -> str:
    """The plan-time table."""
    header = ("N", "layout", "sequences", "budget", "scheduler", "plan ms (median of 3)")
    rows = [
        (
            str(t.domain_size),
            t.layout,
            str(t.num_sequences),
            str(t.budget),
            t.scheduler,
            f"{t.median_ms:.1f}" if t.median_ms is not None else f"n/a ({t.note})",
        )
        for t in timings
    ]
    title = "== plan time: workload-1 lengths; budget ≈ tokens / (8 × N), ≥ max length / cp"
    return title + "\n" + render_table(header, rows, "rlrrlr")


def cmd_benchmark(args: argparse.Namespace) -> int:
    """Reference workloads (tables printed as they finish), then the plan-time runs."""
    comparisons = benchmark_comparisons(args)
    timings = [] if args.no_timing else benchmark_timings(args)
    if args.json:
        data = {
            "workloads": [c.as_dict() for c in comparisons],
            "plan_time": [t.__dict__ for t in timings],
        }
        print(json.dumps(data, indent=2))
    elif timings:
        print(format_timings(timings))
    return 0


def add_benchmark(sub: Any) -> None:
    """The ``benchmark`` subcommand."""
    p = sub.add_parser("benchmark", help="the reference workloads and plan-time scaling")
    p.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        action="append",
        help="restrict to this cost model (repeatable; default both)",
    )
    p.add_argument(
        "--workload",
        action="append",
        metavar="NAME",
        help="restrict to these workloads (repeatable; name or 1-4)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="skip the N=1024 plan-time run")
    p.add_argument("--no-timing", action="store_true", help="skip the plan-time runs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_benchmark)
