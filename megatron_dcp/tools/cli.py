"""``megatron-dcp`` command line: simulate schedulers on a workload, run the reference benchmark,
fuzz the plan invariants. ``main(argv)`` returns the exit code (0 ok, 1 fuzz violations, 2 bad
input)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling import SCHEDULERS, CostModel, build_cost_model, build_scheduler
from megatron_dcp.scheduling.cost import COST_MODELS
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.tools.plot import Panel, plan_panel
from megatron_dcp.tools.simulator import Report, report, timed_schedule
from megatron_dcp.integration.data.lengths import sample_lengths
from megatron_dcp.tools.workloads import (
    REFERENCE_WORKLOADS,
    Workload,
    parse_distribution,
    read_lengths,
    reference_workload,
    summarize,
)

# The simulator's flags for the scheduling parameters its errors name.
FLAGS = {
    "budget": "--max-seqlen-per-dp-cp-rank",
    "min_cp_size": "--min-cp-size",
    "dp_size": "--dp-size",
    "cp_size": "--cp-size",
    "vpp": "--microbatch-group-size-per-vp-stage",
    "scheduler": "--schedulers",
    "cost_model": "--cost-model",
    "batch": "more sequences (--num-sequences, --tokens-per-global-batch)",
    "max_seqlen": "shorter sequences",
}


def error_message(error: ValueError) -> str:
    """``error`` worded with the simulator's flags."""
    return error.worded(FLAGS) if isinstance(error, SchedulingError) else str(error)


PEER_ALIAS = "megatron"
BENCHMARK_SCHEDULERS = ("default_dynamic_cp", "dp_balanced", PEER_ALIAS)
# (dp, cp, sequences) of the plan-time runs; the last one is skipped by --quick.
TIMING_LAYOUTS = ((16, 4, 1024), (256, 4, 16384))
TIMING_REPEATS = 3


@dataclass(frozen=True)
class Layout:
    """Domain layout and scheduler settings shared by every scheduler of one run."""

    dp_size: int
    cp_size: int
    budget: int
    min_cp_size: int = 1
    vpp: Optional[int] = None

    def domain(self) -> Domain:
        """The validated domain (raises ValueError on a bad layout)."""
        return Domain(self.dp_size, self.cp_size, self.budget, self.min_cp_size)

    def describe(self) -> str:
        """One line for table headers."""
        n = self.dp_size * self.cp_size
        extra = f", min CP {self.min_cp_size}" if self.min_cp_size > 1 else ""
        extra += f", VPP group {self.vpp}" if self.vpp else ""
        return f"dp {self.dp_size} × cp {self.cp_size} (N={n}), budget {self.budget}{extra}"


@dataclass
class Row:
    """One scheduler's result: a report, or the reason there is none."""

    scheduler: str
    report: Optional[Report] = None
    note: str = ""
    omitted: bool = False
    panel: Optional[Panel] = None

    def as_dict(self) -> Dict[str, Any]:
        if self.report is not None:
            return self.report.as_dict()
        return {"scheduler": self.scheduler, "error": self.note, "omitted": self.omitted}


@dataclass
class Outcome:
    """All schedulers on one workload under one cost model."""

    title: str
    layout: Layout
    cost_model: str
    lengths: List[int]
    rows: List[Row] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return {
            "workload": self.title,
            "layout": self.layout.__dict__,
            "cost_model": self.cost_model,
            "num_sequences": len(self.lengths),
            "total_tokens": sum(self.lengths),
            "results": [row.as_dict() for row in self.rows],
        }


# ----------------------------------------------------------------------------------------------
# Running schedulers


def run_ours(
    name: str, lengths: Sequence[int], layout: Layout, cost: CostModel, panel: bool
) -> Row:
    """Schedule with a registered scheduler; a ValueError (e.g. a sequence too long) -> n/a."""
    try:
        scheduler = build_scheduler(
            name,
            dp_size=layout.dp_size,
            cp_size=layout.cp_size,
            max_seqlen_per_dp_cp_rank=layout.budget,
            min_cp_size=layout.min_cp_size,
            microbatch_group_size_per_vp_stage=layout.vpp,
            cost_model=cost,
        )
        plan, elapsed = timed_schedule(scheduler, lengths)
    except ValueError as error:
        return Row(name, note=error_message(error))
    result = report(name, plan, cost, elapsed)
    return Row(name, result, panel=plan_panel(plan, cost, result) if panel else None)


def run_peer(lengths: Sequence[int], layout: Layout, cost: CostModel, panel: bool) -> Row:
    """megatron-core's hybrid-CP scheduler; omitted (with a note) when megatron is missing."""
    from megatron_dcp.tools.peers import megatron_hybrid_cp as peer

    domain = layout.domain()
    try:
        result, schedule = peer.simulate_peer(lengths, domain, cost)
    except peer.PeerUnavailable as error:
        return Row(peer.PEER_NAME, note=f"omitted: {error}", omitted=True)
    except Exception as error:  # noqa: BLE001  third-party code: report it, never crash the CLI
        return Row(peer.PEER_NAME, note=f"{type(error).__name__}: {error}")
    drawn = peer.peer_panel(schedule, domain, cost, result) if panel else None
    return Row(peer.PEER_NAME, result, panel=drawn)


def run_scheduler(
    name: str, lengths: Sequence[int], layout: Layout, cost: CostModel, panel: bool = False
) -> Row:
    """A registered scheduler, or the megatron peer for :data:`PEER_ALIAS`."""
    if name == PEER_ALIAS:
        return run_peer(lengths, layout, cost, panel)
    return run_ours(name, lengths, layout, cost, panel)


def evaluate(
    title: str,
    lengths: List[int],
    layout: Layout,
    cost_name: str,
    schedulers: Sequence[str],
    panels: bool = False,
) -> Outcome:
    """Every scheduler of ``schedulers`` on one workload under one cost model."""
    cost = build_cost_model(cost_name)
    outcome = Outcome(title, layout, cost_name, lengths)
    for name in schedulers:
        outcome.rows.append(run_scheduler(name, lengths, layout, cost, panels))
    return outcome


# ----------------------------------------------------------------------------------------------
# Tables


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
    """Columns padded to their widest cell; ``align`` has one 'l' or 'r' per column."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for cells in [header, *rows]:
        padded = [
            cell.ljust(w) if side == "l" else cell.rjust(w)
            for cell, w, side in zip(cells, widths, align)
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def format_histogram(histogram: Dict[int, int]) -> str:
    """``{1: 32, 2: 5}`` -> ``1:32 2:5`` (CP size: number of sequences)."""
    return " ".join(f"{size}:{count}" for size, count in sorted(histogram.items()))


def report_cells(result: Report) -> List[str]:
    """One table row; the peer's micro-batches are its forward passes, with its group count."""
    microbatches = str(result.num_microbatches)
    if result.num_groups is not None:
        microbatches += f" ({result.num_groups} groups)"
    return [
        result.scheduler,
        f"{result.critical_path:.3e}",
        f"{result.ratio:.3f}",
        microbatches,
        f"{result.max_tokens_per_rank:.0f}",
        f"{result.mean_tokens_per_rank:.0f}",
        format_histogram(result.cp_size_histogram),
        f"{result.plan_time_s * 1e3:.1f}",
    ]


RESULT_HEADER = (
    "scheduler",
    "critical path",
    "CP/LB",
    "micro-batches",
    "max tok/rank",
    "mean tok/rank",
    "CP sizes (size:seqs)",
    "plan ms",
)


def format_outcome(outcome: Outcome) -> str:
    """The workload header, the table, then the n/a and omitted rows as notes."""
    lines = [
        f"== {outcome.title} | {outcome.layout.describe()} | cost model '{outcome.cost_model}'",
        f"   {summarize(outcome.lengths)}",
    ]
    reports = [row.report for row in outcome.rows if row.report is not None]
    if reports:
        lines.append(f"   lower bound {reports[0].lower_bound:.3e}")
        lines.append(render_table(RESULT_HEADER, [report_cells(r) for r in reports], "lrrrrrlr"))
    for row in outcome.rows:
        if row.report is None:
            prefix = "note" if row.omitted else "n/a "
            lines.append(f"{prefix}  {row.scheduler}: {row.note}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# simulate


def scheduler_names(requested: Optional[List[str]], no_peer: bool) -> List[str]:
    """--scheduler values, default every registered scheduler plus the peer."""
    names = requested or [*sorted(SCHEDULERS), PEER_ALIAS]
    return [name for name in names if not (no_peer and name == PEER_ALIAS)]


def simulate_layout(args: argparse.Namespace, workload: Workload) -> Layout:
    """Layout flags, each defaulting to the --workload's value."""
    return Layout(
        args.dp_size or workload.dp_size,
        args.cp_size or workload.cp_size,
        args.max_seqlen_per_dp_cp_rank or workload.budget,
        args.min_cp_size,
        args.microbatch_group_size_per_vp_stage,
    )


def simulate_lengths(args: argparse.Namespace, layout: Layout, workload: Workload) -> List[int]:
    """From --lengths, or sampled from --distribution (default: the chosen workload's)."""
    if args.lengths:
        return read_lengths(args.lengths)
    dist = parse_distribution(args.distribution or workload.distribution)
    if args.num_sequences:
        return sample_lengths(dist, args.seed, num_sequences=args.num_sequences)
    total = args.tokens_per_global_batch or 8 * layout.dp_size * layout.cp_size * layout.budget
    return sample_lengths(dist, args.seed, total_tokens=total)


def simulate_title(args: argparse.Namespace, workload: Workload) -> str:
    """Where the lengths came from."""
    if args.lengths:
        return f"lengths from {args.lengths}"
    return f"distribution {args.distribution or workload.distribution} (seed {args.seed})"


def write_plot(outcome: Outcome, path: str) -> None:
    """One panel per scheduler that produced a plan."""
    from megatron_dcp.tools.plot import plot_panels

    panels = [row.panel for row in outcome.rows if row.panel is not None]
    plot_panels(panels, path, f"{outcome.layout.describe()} · {summarize(outcome.lengths)}")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Every chosen scheduler on one workload; exit 2 when none could plan it."""
    workload = reference_workload(args.workload)
    layout = simulate_layout(args, workload)
    layout.domain()  # validate the layout before sampling
    lengths = simulate_lengths(args, layout, workload)
    names = scheduler_names(args.scheduler, args.no_peer)
    title = simulate_title(args, workload)
    outcome = evaluate(title, lengths, layout, args.cost_model, names, panels=bool(args.plot))
    print(json.dumps(outcome.as_dict(), indent=2) if args.json else format_outcome(outcome))
    if args.plot:
        write_plot(outcome, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0 if any(row.report for row in outcome.rows) else 2


# ----------------------------------------------------------------------------------------------
# benchmark


def benchmark_outcomes(args: argparse.Namespace) -> List[Outcome]:
    """Every selected reference workload under every selected cost model, printed as it goes."""
    workloads = (
        [reference_workload(w) for w in args.workload] if args.workload else REFERENCE_WORKLOADS
    )
    outcomes = []
    for cost_name in args.cost_model or list(COST_MODELS):
        for workload in workloads:
            layout = Layout(workload.dp_size, workload.cp_size, workload.budget)
            title = f"{workload.name}: {workload.description}"
            lengths = workload.lengths(args.seed)
            outcome = evaluate(title, lengths, layout, cost_name, BENCHMARK_SCHEDULERS)
            outcomes.append(outcome)
            if not args.json:
                print(format_outcome(outcome) + "\n", flush=True)
    return outcomes


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


def time_scheduler(name: str, lengths: List[int], layout: Layout, cost: CostModel) -> Timing:
    """Median of :data:`TIMING_REPEATS` plan times (the first failure makes it n/a)."""
    n = layout.dp_size * layout.cp_size
    desc = f"dp {layout.dp_size} × cp {layout.cp_size}"
    rows = [run_scheduler(name, lengths, layout, cost) for _ in range(TIMING_REPEATS)]
    failed = [row for row in rows if row.report is None]
    if failed:
        return Timing(n, desc, len(lengths), layout.budget, rows[0].scheduler, None, failed[0].note)
    median = statistics.median(row.report.plan_time_s * 1e3 for row in rows)
    return Timing(n, desc, len(lengths), layout.budget, rows[0].scheduler, median)


def benchmark_timings(args: argparse.Namespace) -> List[Timing]:
    """Plan time at N=64 (and N=1024 unless --quick), median of 3 runs."""
    cost = build_cost_model("model")
    timings = []
    for dp, cp, count in TIMING_LAYOUTS[:1] if args.quick else TIMING_LAYOUTS:
        lengths, budget = timing_lengths(count, dp, cp, args.seed)
        for name in BENCHMARK_SCHEDULERS:
            timings.append(time_scheduler(name, lengths, Layout(dp, cp, budget), cost))
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
    outcomes = benchmark_outcomes(args)
    timings = [] if args.no_timing else benchmark_timings(args)
    if args.json:
        data = {
            "workloads": [o.as_dict() for o in outcomes],
            "plan_time": [t.__dict__ for t in timings],
        }
        print(json.dumps(data, indent=2))
    elif timings:
        print(format_timings(timings))
    return 0


# ----------------------------------------------------------------------------------------------
# fuzz


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Run the plan-invariant fuzzer; exit 1 on any violation."""
    try:
        from megatron_dcp.tools.fuzz import run_fuzz
    except ImportError as error:
        print(f"megatron-dcp fuzz: the fuzzer is not available ({error}).", file=sys.stderr)
        return 2
    result = run_fuzz(cases=args.cases, seed=args.seed)
    stored = list(result.violations)
    # FuzzResult keeps only the first few (shrunk) violations; violation_count has the total.
    count = getattr(result, "violation_count", len(stored))
    print(f"fuzz: {result.cases} cases, {count} violations (seed {args.seed})")
    for violation in stored[: args.show]:
        print(f"  {violation}")
    if count > min(len(stored), args.show):
        print(f"  ... and {count - min(len(stored), args.show)} more")
    return 1 if count else 0


# ----------------------------------------------------------------------------------------------
# Argument parsing


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 1")
    return value


def power_of_two(text: str) -> int:
    """argparse type: 1, 2, 4, ..."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two (use 1, 2, 4, ...)")
    return value


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    """Domain layout flags (names as in Megatron where it has them)."""
    parser.add_argument("--dp-size", type=positive_int, metavar="N", help="data-parallel size")
    parser.add_argument("--cp-size", type=positive_int, metavar="N", help="context-parallel size")
    parser.add_argument(
        "--max-seqlen-per-dp-cp-rank",
        type=positive_int,
        metavar="TOKENS",
        help="per-rank token budget of a micro-batch",
    )
    parser.add_argument(
        "--min-cp-size", type=power_of_two, default=1, metavar="N", help="smallest CP group size"
    )
    parser.add_argument(
        "--microbatch-group-size-per-vp-stage",
        type=positive_int,
        metavar="K",
        help="with VPP: the micro-batch count must be a multiple of K",
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Where the lengths come from and how many."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--lengths", metavar="FILE", help="one sequence length per line")
    source.add_argument(
        "--distribution",
        metavar="SPEC",
        help="e.g. 'lognormal:median=1024,sigma=1.0,max=8192', 'uniform:min=1,max=32K', "
        "'mixture:0.99*lognormal:median=1024,sigma=1|0.01*uniform:min=32K,max=256K'",
    )
    count = parser.add_mutually_exclusive_group()
    count.add_argument(
        "--num-sequences", type=positive_int, metavar="N", help="sample this many sequences"
    )
    count.add_argument(
        "--tokens-per-global-batch",
        type=positive_int,
        metavar="TOKENS",
        help="sample until this many tokens (default 8 × N × budget)",
    )
    parser.add_argument(
        "--workload",
        default="lognormal",
        metavar="NAME",
        help="reference workload giving the defaults for layout and distribution "
        f"({', '.join(w.name for w in REFERENCE_WORKLOADS)})",
    )


def add_simulate(sub: Any) -> None:
    """The ``simulate`` subcommand."""
    choices = [*sorted(SCHEDULERS), PEER_ALIAS]
    p = sub.add_parser("simulate", help="compare schedulers on one workload")
    p.add_argument(
        "--scheduler",
        action="append",
        choices=choices,
        help=f"repeatable; default: all ({PEER_ALIAS} = megatron-core 0.19.2 BalancedCPScheduler)",
    )
    add_layout_args(p)
    add_workload_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the length sampler")
    p.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        default="model",
        help="model: GEMM + attention + CP overhead of a Llama-3-8B-like model; attention: L²/c",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE.png", help="draw every plan into one PNG")
    p.add_argument("--no-peer", action="store_true", help=f"skip the {PEER_ALIAS} peer")
    p.set_defaults(func=cmd_simulate)


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


def add_fuzz(sub: Any) -> None:
    """The ``fuzz`` subcommand."""
    p = sub.add_parser("fuzz", help="check plan invariants on random inputs")
    p.add_argument("--cases", type=positive_int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=20, help="violations to print")
    p.set_defaults(func=cmd_fuzz)


def build_parser() -> argparse.ArgumentParser:
    """The ``megatron-dcp`` argument parser with its three subcommands."""
    parser = argparse.ArgumentParser(
        prog="megatron-dcp",
        description="Dynamic Context Parallelism scheduling tools: simulate schedulers on a "
        "workload, run the reference benchmark, fuzz the plan invariants. See docs/simulator.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate(sub)
    add_benchmark(sub)
    add_fuzz(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``megatron-dcp`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"megatron-dcp {args.command}: error: {error_message(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
