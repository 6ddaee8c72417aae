"""``megatron-dcp benchmark``: the target matrix (the reference workloads at each per-rank
budget and VPP group size, under each cost model: our scheduler beside Megatron dev's greedy
scheduler and megatron-core 0.19.2's), then the plan time, plan quality and peak planning memory
of the schedulers at N = 64, 1024, 4096 and 16384 (16 sequences per rank).

A workload's layout (dp × cp) is its own; its batch holds 8 × N × budget tokens, and lengths
are capped at N × budget, the longest sequence the domain holds at that budget.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.integration.data.lengths import sample_lengths
from megatron_dcp.scheduling import CostModel, build_cost_model
from megatron_dcp.tools.compare import (
    DEV_PEER_ALIAS,
    PEER_ALIAS,
    Comparison,
    DomainSpec,
    chosen_costs,
    evaluate,
    na_reasons,
    render_table,
    run_scheduler,
)
from megatron_dcp.tools.plan_memory import schedule_peak_mib
from megatron_dcp.tools.progress import Progress
from megatron_dcp.tools.topology_table import format_tier_table, tier_row
from megatron_dcp.tools.workloads import (
    REFERENCE_WORKLOADS,
    Workload,
    parse_distribution,
    reference_workload,
)

OURS = "default_dynamic_cp"
BENCHMARK_SCHEDULERS = (OURS, DEV_PEER_ALIAS, PEER_ALIAS)
DEFAULT_COST_MODELS = ("model", "latency")
DEFAULT_BUDGETS = (2048, 4096)
DEFAULT_VPP = (1, 2, 4)
# The quality target: a critical path within this factor of the lower bound.
TARGET_RATIO = 1.05
# Critical paths within this relative difference are equal (float summation order).
TIE = 1e-9
# The dev peer is our re-implementation of upstream's algorithm, written for clarity, not speed:
# its plan time says nothing about upstream's, so the plan-time table leaves it out.
TIMED_SCHEDULERS = (OURS, "dp_balanced", PEER_ALIAS)
# (dp, cp, sequences) of the plan-time runs, 16 sequences per rank; --quick keeps the first,
# --max-timing-n drops those of a larger domain.
TIMING_LAYOUTS = ((16, 4, 1024), (256, 4, 16384), (1024, 4, 65536), (4096, 4, 262144))
TIMING_REPEATS = 3
# From this domain size on one plan takes tens of seconds: one timed run instead of a median.
SINGLE_RUN_N = 16384
# The 0.19.2 peer is timed up to this domain size only: its plan time grows about quadratically
# with N (~15 s per plan at N = 1024 on 2 cores, minutes at N = 4096).
PEER_MAX_TIMING_N = 1024
DEFAULT_MAX_TIMING_N = 16384


def matrix_lengths(workload: Workload, budget: int, seed: int) -> List[int]:
    """8 × N × budget tokens of the workload's distribution, capped at N × budget."""
    n = workload.domain_size
    dist = parse_distribution(workload.distribution)
    lengths = sample_lengths(dist, seed, total_tokens=8 * n * budget)
    return [min(length, n * budget) for length in lengths]


def matrix_cases(args: argparse.Namespace) -> List[Tuple[Workload, int, int]]:
    """(workload, budget, VPP group size) of every case the flags select."""
    workloads = (
        [reference_workload(w) for w in args.workload] if args.workload else REFERENCE_WORKLOADS
    )
    budgets = args.budget or DEFAULT_BUDGETS
    vpps = args.vpp or DEFAULT_VPP
    return [(w, b, v) for w in workloads for b in budgets for v in vpps]


def benchmark_comparisons(args: argparse.Namespace) -> List[Comparison]:
    """Every case under every selected cost model; each cost model's table printed as it ends
    (its progress on stderr until then)."""
    comparisons, cases = [], matrix_cases(args)
    for label, cost in chosen_costs(args.cost_model or DEFAULT_COST_MODELS, args.cost_profile):
        table, tiers = [], []
        progress = Progress(
            f"benchmark: cost model '{label}'", len(cases), "cases", stream=sys.stderr
        )
        for workload, budget, vpp in cases:
            vpp_group = vpp if vpp > 1 else None
            spec = DomainSpec(
                workload.dp_size,
                workload.cp_size,
                budget,
                vpp=vpp_group,
                ranks_per_node=args.ranks_per_node,
            )
            title = f"{workload.name} b{budget} vpp{vpp}"
            lengths = matrix_lengths(workload, budget, args.seed)
            table.append(evaluate(title, lengths, spec, (label, cost), BENCHMARK_SCHEDULERS))
            if args.ranks_per_node:
                tiers.append(tier_row(title, lengths, spec, cost))
            progress.update(len(table), title)
        comparisons += table
        if not args.json:
            print(format_matrix(label, table) + "\n", flush=True)
            if tiers:
                print(format_tier_table(label, args.ranks_per_node, tiers) + "\n", flush=True)
    ratios = dev_ratios(comparisons)
    if not args.json and ratios and len(comparisons) > len(matrix_cases(args)):
        mean = statistics.mean(ratios)
        print(
            f"all cost models: ours/dev mean {mean:.4f} ({1 - mean:.2%} shorter) over "
            f"{len(ratios)} cases\n",
            flush=True,
        )
    return comparisons


def dev_ratio(comparison: Comparison) -> Optional[float]:
    """Our critical path over the dev peer's; None unless both have a plan."""
    ours, dev = (list(figures(comparison).values()) + [None] * 2)[:2]
    return ours.critical_path / dev.critical_path if ours and dev else None


def dev_ratios(table: Sequence[Comparison]) -> List[float]:
    """:func:`dev_ratio` of each case where both have a plan."""
    return [ratio for ratio in map(dev_ratio, table) if ratio is not None]


def figures(comparison: Comparison) -> Dict[str, Any]:
    """scheduler -> report (None when it has no plan)."""
    return {result.scheduler: result.report for result in comparison.results}


def cell(report: Any) -> str:
    """``CP/LB (micro-batches)`` or n/a."""
    return "n/a" if report is None else f"{report.ratio:.3f} ({report.num_microbatches})"


def format_matrix(label: str, table: Sequence[Comparison]) -> str:
    """One row per case, ours beside the peers, and the summary of the targets."""
    header = (
        "case",
        "layout",
        "ours CP/LB (mb)",
        "dev CP/LB (mb)",
        "ours/dev",
        "0.19.2 CP/LB (mb)",
        "plan ms",
    )
    rows, ratios, within = [], dev_ratios(table), 0
    for comparison in table:
        reports = list(figures(comparison).values())
        ours, dev, old = (reports + [None] * 3)[:3]
        ratio = dev_ratio(comparison)
        within += bool(ours and ours.ratio <= TARGET_RATIO)
        layout = f"dp{comparison.spec.dp_size}×cp{comparison.spec.cp_size}"
        rows.append(
            (
                comparison.title,
                layout,
                cell(ours),
                cell(dev),
                f"{ratio:.3f}" if ratio is not None else "n/a",
                cell(old),
                f"{ours.plan_time_s * 1e3:.1f}" if ours else "n/a",
            )
        )
    summary = (
        f"ours/dev: mean {statistics.mean(ratios):.3f}, worst {max(ratios):.3f}, "
        f"ours ≤ dev in {sum(r <= 1 + TIE for r in ratios)}/{len(ratios)}; "
        f"ours ≤ {TARGET_RATIO} × LB in {within}/{len(table)}"
        if ratios
        else "no case with both plans"
    )
    title = f"== cost model '{label}': CP/LB = critical path / lower bound, (mb) = micro-batches"
    labels = ("ours", "dev", "0.19.2")
    reasons = na_reasons([(c.title, list(zip(labels, c.results))) for c in table])
    return "\n".join([title, render_table(header, rows, "llrrrrr"), *reasons, summary])


@dataclass(frozen=True)
class Timing:
    """One scheduler at one domain size: median plan time of ``repeats`` runs, the plan's
    critical path / lower bound and micro-batches, and the peak memory of one untimed traced
    run (all None when it has no plan, with the reason in ``note``)."""

    domain_size: int
    layout: str
    num_sequences: int
    budget: int
    scheduler: str
    median_ms: Optional[float]
    note: str = ""
    repeats: int = TIMING_REPEATS
    ratio: Optional[float] = None
    num_microbatches: Optional[int] = None
    peak_mib: Optional[float] = None


def timing_lengths(count: int, dp: int, cp: int, seed: int) -> Tuple[List[int], int]:
    """Workload-1-like lengths and the budget that makes them ≈ 8 × N × budget tokens, raised to
    max length / cp where needed so that static CP (dp_balanced) can hold every sequence."""
    lengths = sample_lengths(parse_distribution(REFERENCE_WORKLOADS[0].distribution), seed, count)
    budget = math.ceil(sum(lengths) / (8 * dp * cp))
    return lengths, max(budget, math.ceil(max(lengths) / cp))


def time_scheduler(
    name: str,
    lengths: List[int],
    spec: DomainSpec,
    cost: CostModel,
    repeats: int = TIMING_REPEATS,
) -> Timing:
    """Median of ``repeats`` plan times (the first failure makes it n/a), then the peak memory
    of one more run under tracemalloc, which is never timed (it slows Python down)."""
    n = spec.dp_size * spec.cp_size
    fixed = (n, f"dp {spec.dp_size} × cp {spec.cp_size}", len(lengths), spec.budget)
    results = [run_scheduler(name, lengths, spec, cost) for _ in range(repeats)]
    failed = [result for result in results if result.report is None]
    scheduler = results[0].scheduler
    if failed:
        return Timing(*fixed, scheduler, None, failed[0].note, repeats)
    median = statistics.median(result.report.plan_time_s * 1e3 for result in results)
    first = results[0].report
    peak = schedule_peak_mib(name, lengths, spec, cost)
    return Timing(*fixed, scheduler, median, "", repeats, first.ratio, first.num_microbatches, peak)


def timing_layouts(args: argparse.Namespace) -> List[Tuple[int, int, int]]:
    """The plan-time layouts the flags keep: the first with --quick, none above --max-timing-n."""
    layouts = TIMING_LAYOUTS[:1] if args.quick else TIMING_LAYOUTS
    return [(dp, cp, count) for dp, cp, count in layouts if dp * cp <= args.max_timing_n]


def timed_schedulers(domain_size: int) -> Tuple[str, ...]:
    """The schedulers timed at this domain size (the 0.19.2 peer up to PEER_MAX_TIMING_N)."""
    if domain_size <= PEER_MAX_TIMING_N:
        return TIMED_SCHEDULERS
    return tuple(name for name in TIMED_SCHEDULERS if name != PEER_ALIAS)


def benchmark_timings(args: argparse.Namespace) -> List[Timing]:
    """Plan time (median of 3 runs, 1 from N = SINGLE_RUN_N on), CP/LB, micro-batches and peak
    memory of each timed scheduler at each kept layout (the progress on stderr)."""
    cost, layouts, timings = build_cost_model("model"), timing_layouts(args), []
    runs = sum(len(timed_schedulers(dp * cp)) for dp, cp, _ in layouts)
    progress = Progress("benchmark: plan time", runs, "scheduler runs", stream=sys.stderr)
    for dp, cp, count in layouts:
        lengths, budget = timing_lengths(count, dp, cp, args.seed)
        spec, repeats = DomainSpec(dp, cp, budget), 1 if dp * cp >= SINGLE_RUN_N else TIMING_REPEATS
        for name in timed_schedulers(dp * cp):
            timings.append(time_scheduler(name, lengths, spec, cost, repeats))
            progress.update(len(timings), f"N={dp * cp} {timings[-1].scheduler}")
    return timings


def optional(value: Optional[float], spec: str) -> str:
    """``value`` formatted, or n/a."""
    return "n/a" if value is None else format(value, spec)


def format_timings(timings: Sequence[Timing]) -> str:
    """The plan-time table, with a note line for the runs it leaves out."""
    header = (
        "N",
        "layout",
        "sequences",
        "budget",
        "scheduler",
        "plan ms",
        "CP/LB",
        "mb",
        "peak MiB",
    )
    rows = [
        (
            str(t.domain_size),
            t.layout,
            str(t.num_sequences),
            str(t.budget),
            t.scheduler,
            f"{t.median_ms:.1f}" if t.median_ms is not None else f"n/a ({t.note})",
            optional(t.ratio, ".3f"),
            optional(t.num_microbatches, "d"),
            optional(t.peak_mib, ".2f"),
        )
        for t in timings
    ]
    single = sorted({t.domain_size for t in timings if t.repeats == 1})
    runs = f" (1 run at N = {', '.join(map(str, single))})" if single else ""
    lines = [
        "== plan time: workload-1 lengths; budget ≈ tokens / (8 × N), ≥ max length / cp",
        f"   plan ms: median of {TIMING_REPEATS} runs{runs}; CP/LB: critical path / lower bound "
        "('model' cost);",
        "   mb: micro-batches; peak MiB: tracemalloc's peak in schedule(), a separate untimed run",
        render_table(header, rows, "rlrrlrrrr"),
    ]
    if PEER_ALIAS in TIMED_SCHEDULERS and any(t.domain_size > PEER_MAX_TIMING_N for t in timings):
        lines.append(
            f"note: megatron-0.19.2 BalancedCPScheduler is timed up to N = {PEER_MAX_TIMING_N} "
            "only: its plan time grows about quadratically with N (minutes per plan at N = 4096)"
        )
    return "\n".join(lines)
