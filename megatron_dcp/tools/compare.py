"""Running schedulers side by side on one workload (shared by ``simulate`` and ``benchmark``):
the simulated domain (:class:`DomainSpec`), one scheduler's :class:`SchedulerResult`, all of them
as a :class:`Comparison`, and its table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling import CostModel, Scheduler, build_cost_model, build_scheduler
from megatron_dcp.scheduling.cost_fit import load_profile
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.hardware import REFERENCE_GPU_PROFILE, hardware_profile
from megatron_dcp.scheduling.topology import NodeLayout, node_layout
from megatron_dcp.tools.error_wording import error_message
from megatron_dcp.tools.plan_report import Report, report, timed_schedule
from megatron_dcp.tools.plot import Panel, plan_panel
from megatron_dcp.tools.workloads import summarize

# The names that select the peers among ours: megatron-core 0.19.2's hybrid-CP scheduler and
# Megatron dev's greedy dynamic-CP scheduler.
PEER_ALIAS = "megatron"
DEV_PEER_ALIAS = "megatron-dev"
PEER_ALIASES = (PEER_ALIAS, DEV_PEER_ALIAS)


@dataclass(frozen=True)
class DomainSpec:
    """The simulated domain (dp, cp, budget, min CP, VPP) shared by every scheduler of one run."""

    dp_size: int
    cp_size: int
    budget: int
    min_cp_size: int = 1
    vpp: Optional[int] = None
    # Ranks per node (positions are global ranks here, TP 1); None: one node, one link tier.
    ranks_per_node: Optional[int] = None

    def domain(self) -> Domain:
        """The validated domain (raises ValueError on bad settings)."""
        return Domain(self.dp_size, self.cp_size, self.budget, self.min_cp_size)

    def node_layout(self) -> Optional[NodeLayout]:
        """The domain's node layout priced with the GPU profile's two link tiers (None without
        ``ranks_per_node``)."""
        domain = self.domain()
        return node_layout(
            domain, range(domain.size), self.ranks_per_node, hardware_profile(REFERENCE_GPU_PROFILE)
        )

    def priced(self, cost: CostModel) -> CostModel:
        """``cost`` over this domain's node layout (unchanged without ``ranks_per_node``)."""
        return cost if self.ranks_per_node is None else cost.with_nodes(self.node_layout())

    def describe(self) -> str:
        """One line for table headers."""
        n = self.dp_size * self.cp_size
        extra = f", min CP {self.min_cp_size}" if self.min_cp_size > 1 else ""
        extra += f", VPP group {self.vpp}" if self.vpp else ""
        extra += f", {self.ranks_per_node} ranks per node" if self.ranks_per_node else ""
        return f"dp {self.dp_size} × cp {self.cp_size} (N={n}), budget {self.budget}{extra}"


@dataclass
class SchedulerResult:
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
class Comparison:
    """All schedulers on one workload under one cost model."""

    title: str
    spec: DomainSpec
    cost_model: str
    lengths: List[int]
    results: List[SchedulerResult] = field(default_factory=list)
    # Each sample's vision-encoder patches (empty: a text batch).
    patches: Sequence[int] = ()

    def as_dict(self) -> Dict[str, Any]:
        extra = {"total_patches": sum(self.patches)} if any(self.patches) else {}
        return {
            "workload": self.title,
            "layout": self.spec.__dict__,
            "cost_model": self.cost_model,
            "num_sequences": len(self.lengths),
            "total_tokens": sum(self.lengths),
            **extra,
            "results": [result.as_dict() for result in self.results],
        }


# ----------------------------------------------------------------------------------------------
# Running schedulers


def run_ours(
    name: str,
    lengths: Sequence[int],
    spec: DomainSpec,
    cost: CostModel,
    panel: bool,
    patches: Optional[Sequence[int]] = None,
) -> SchedulerResult:
    """Schedule with a registered scheduler; a ValueError (e.g. a sequence too long) -> n/a."""
    build = lambda: build_scheduler(name, **scheduler_kwargs(spec, cost))  # noqa: E731
    return run_plan(name, build, lengths, cost, panel, patches)


def run_dev_peer(
    lengths: Sequence[int],
    spec: DomainSpec,
    cost: CostModel,
    panel: bool,
    patches: Optional[Sequence[int]] = None,
) -> SchedulerResult:
    """Megatron dev's greedy scheduler (``tools.peers.megatron_dev_greedy``): it plans blind to
    ``patches``, and its plan is priced with them like ours."""
    from megatron_dcp.tools.peers.megatron_dev_greedy import PEER_NAME, DevGreedyPeer

    build = lambda: DevGreedyPeer(**scheduler_kwargs(spec, cost))  # noqa: E731
    return run_plan(PEER_NAME, build, lengths, cost, panel, patches)


def scheduler_kwargs(spec: DomainSpec, cost: CostModel) -> Dict[str, Any]:
    return dict(
        dp_size=spec.dp_size,
        cp_size=spec.cp_size,
        max_seqlen_per_dp_cp_rank=spec.budget,
        min_cp_size=spec.min_cp_size,
        microbatch_group_size_per_vp_stage=spec.vpp,
        cost_model=cost,
    )


def run_plan(
    name: str,
    build: Callable[[], Scheduler],
    lengths: Sequence[int],
    cost: CostModel,
    panel: bool,
    patches: Optional[Sequence[int]] = None,
) -> SchedulerResult:
    """Build a scheduler and plan ``lengths`` (with each sample's encoder ``patches``, which
    the plan keeps and every figure prices); a ValueError (bad input, no plan) -> n/a."""
    try:
        plan, elapsed = timed_schedule(build(), lengths, patches)
    except ValueError as error:
        return SchedulerResult(name, note=without_prefix(error_message(error), name))
    plan_report = report(name, plan, cost, elapsed)
    drawn = plan_panel(plan, cost, plan_report) if panel else None
    return SchedulerResult(name, plan_report, panel=drawn)


def without_prefix(note: str, name: str) -> str:
    """``note`` without a leading ``"{name}: "`` (the peers name themselves in their errors)."""
    return note[len(name) + 2 :] if note.startswith(f"{name}: ") else note


def shortened(note: str, limit: int = 160) -> str:
    """``note`` cut to at most ``limit`` characters at a word boundary, marked with '…'."""
    if len(note) <= limit:
        return note
    return note[: note.rfind(" ", 0, limit - 1)].rstrip(" ,;:") + " …"


def na_reasons(cases: Sequence[Tuple[str, Sequence[Tuple[str, "SchedulerResult"]]]]) -> List[str]:
    """One line per reason a cell of a table is n/a: ``cases`` are (row title, [(column label,
    result)]); the rows that share a column and a reason share a line."""
    rows: Dict[Tuple[str, str, bool], List[str]] = {}
    for title, columns in cases:
        for label, result in columns:
            if result.report is None:
                key = (label, shortened(result.note), result.omitted)
                rows.setdefault(key, []).append(title)
    return [
        f"{'note' if omitted else 'n/a '}  {label} in {', '.join(titles)}: {note}"
        for (label, note, omitted), titles in rows.items()
    ]


def run_peer(
    lengths: Sequence[int], spec: DomainSpec, cost: CostModel, panel: bool
) -> SchedulerResult:
    """megatron-core's hybrid-CP scheduler; omitted (with a note) when megatron is missing."""
    from megatron_dcp.tools.peers import megatron_hybrid_cp as peer

    domain = spec.domain()
    try:
        peer_report, schedule = peer.simulate_peer(lengths, domain, cost)
    except peer.PeerUnavailable as error:
        return SchedulerResult(peer.PEER_NAME, note=f"omitted: {error}", omitted=True)
    except Exception as error:  # noqa: BLE001  third-party code: report it, never crash the CLI
        return SchedulerResult(peer.PEER_NAME, note=f"{type(error).__name__}: {error}")
    drawn = peer.peer_panel(schedule, domain, cost, peer_report) if panel else None
    return SchedulerResult(peer.PEER_NAME, peer_report, panel=drawn)


def run_scheduler(
    name: str,
    lengths: Sequence[int],
    spec: DomainSpec,
    cost: CostModel,
    panel: bool = False,
    patches: Optional[Sequence[int]] = None,
) -> SchedulerResult:
    """A registered scheduler, or a peer for :data:`PEER_ALIAS` / :data:`DEV_PEER_ALIAS`. With
    ``patches`` (vision work), the 0.19.2 peer is omitted: its figures have no vision term."""
    if name == PEER_ALIAS:
        if patches and any(patches):
            note = "omitted: its figures do not price vision-encoder patches"
            return SchedulerResult("megatron-0.19.2 BalancedCPScheduler", note=note, omitted=True)
        return run_peer(lengths, spec, cost, panel)
    if name == DEV_PEER_ALIAS:
        return run_dev_peer(lengths, spec, cost, panel, patches)
    return run_ours(name, lengths, spec, cost, panel, patches)


def chosen_costs(names: Sequence[str], profile: Optional[str]) -> List[Tuple[str, CostModel]]:
    """(label, cost model) to plan with: the ``--cost-profile`` file's when given, else the
    named built-in ones."""
    if profile:
        loaded = load_profile(profile, flag="--cost-profile").cost
        return [(f"profile {loaded.name}", loaded)]
    return [(name, build_cost_model(name)) for name in names]


def evaluate(
    title: str,
    lengths: List[int],
    spec: DomainSpec,
    cost: Tuple[str, CostModel],
    schedulers: Sequence[str],
    panels: bool = False,
    patches: Optional[Sequence[int]] = None,
) -> Comparison:
    """Every scheduler of ``schedulers`` on one workload (with each sample's encoder
    ``patches``, None: a text batch) under one (label, cost model)."""
    label, model = cost[0], spec.priced(cost[1])
    comparison = Comparison(title, spec, label, lengths, patches=tuple(patches or ()))
    for name in schedulers:
        result = run_scheduler(name, lengths, spec, model, panels, patches)
        comparison.results.append(result)
    return comparison


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


def report_cells(plan_report: Report) -> List[str]:
    """One table row; the peer's micro-batches are its forward passes, with its group count."""
    microbatches = str(plan_report.num_microbatches)
    if plan_report.num_groups is not None:
        microbatches += f" ({plan_report.num_groups} groups)"
    crossing = [] if plan_report.crossing_groups is None else [str(plan_report.crossing_groups)]
    return [
        plan_report.scheduler,
        *crossing,
        f"{plan_report.critical_path:.3e}",
        f"{plan_report.ratio:.3f}",
        microbatches,
        f"{plan_report.max_tokens_per_rank:.0f}",
        f"{plan_report.mean_tokens_per_rank:.0f}",
        format_histogram(plan_report.cp_size_histogram),
        f"{plan_report.plan_time_s * 1e3:.1f}",
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


def format_comparison(comparison: Comparison) -> str:
    """The workload header, the table, then the n/a and omitted rows as notes."""
    lines = [
        f"== {comparison.title} | {comparison.spec.describe()} "
        f"| cost model '{comparison.cost_model}'",
        f"   {summarize(comparison.lengths, comparison.patches)}",
    ]
    reports = [result.report for result in comparison.results if result.report is not None]
    if reports:
        lines.append(f"   lower bound {reports[0].lower_bound:.3e}")
        crossing = comparison.spec.ranks_per_node is not None
        header = [RESULT_HEADER[0], *(["groups crossing nodes"] if crossing else [])]
        header += RESULT_HEADER[1:]
        align = "lr" + "r" * crossing + "rrrrlr"
        lines.append(render_table(header, [report_cells(r) for r in reports], align))
    for result in comparison.results:
        if result.report is None:
            prefix = "note" if result.omitted else "n/a "
            lines.append(f"{prefix}  {result.scheduler}: {result.note}")
    return "\n".join(lines)
