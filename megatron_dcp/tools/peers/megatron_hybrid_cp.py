"""megatron-core 0.19.2's hybrid-CP scheduler as a peer in the simulator.

``megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler`` splits a global batch
into barrier-separated *groups*; inside a group each rank runs its samples one forward pass each,
with no per-rank token budget, and a sample listed by ``c`` ranks runs with CP size ``c``. We run
the real class (no re-implementation) and score its schedule under OUR cost model:

* critical path = Σ_groups max_rank Σ_{samples of the rank} (``cost.group_cost([L], c)`` +
  ``cost.microbatch``) (one forward pass per sample, so each pays its own ring steps and fixed
  cost);
* ``num_microbatches`` = the most forward passes (samples) any rank runs; ``num_groups`` = groups;
* tokens per rank = per group and rank Σ ``L / c``.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.lower_bound import batch_lower_bound
from megatron_dcp.tools.plan_report import Report
from megatron_dcp.tools.plot import Cell, Panel, panel_title

PEER_NAME = "megatron-0.19.2 BalancedCPScheduler"

# sample_id_groups[g][rank] = sample ids that rank runs in group g, in order.
SampleIdGroups = List[List[List[int]]]


class PeerUnavailable(RuntimeError):
    """megatron-core (with its hybrid-CP scheduler) cannot be imported here."""


@dataclass(frozen=True)
class _DomainGroup:
    """Stands in for ``dp_cp_group``: the scheduler only calls ``.size()``."""

    world: int

    def size(self) -> int:
        return self.world


@dataclass(frozen=True)
class PeerTeam:
    """Ranks of one group that run the same samples (one CP team), with their per-rank load."""

    ranks: Tuple[int, ...]
    sample_ids: Tuple[int, ...]
    load: float


@dataclass(frozen=True)
class PeerSchedule:
    """The peer's schedule of one global batch, scored under a cost model."""

    seqlens: Tuple[int, ...]
    sample_id_groups: SampleIdGroups
    plan_time_s: float

    @property
    def num_groups(self) -> int:
        return len(self.sample_id_groups)

    def cp_sizes(self, group: int) -> Dict[int, int]:
        """Sample id -> CP size (number of ranks listing it) in one group."""
        return dict(Counter(i for ids in self.sample_id_groups[group] for i in ids))

    def rank_loads(self, group: int, cost: CostModel) -> List[float]:
        """Per-rank cost of one group: each sample is its own forward pass, so it pays its own
        ring steps and fixed cost: Σ over the rank's samples of ``group_cost([L], c)`` +
        ``microbatch``."""
        sizes = self.cp_sizes(group)
        return [
            sum(cost.group_cost([self.seqlens[i]], sizes[i]) + cost.microbatch for i in ids)
            for ids in self.sample_id_groups[group]
        ]

    def rank_tokens(self, group: int) -> List[float]:
        """Per-rank tokens of one group: Σ over the rank's samples of ``L / c``."""
        sizes = self.cp_sizes(group)
        return [
            sum(self.seqlens[i] / sizes[i] for i in ids) for ids in self.sample_id_groups[group]
        ]

    def teams(self, group: int, cost: CostModel) -> List[PeerTeam]:
        """Ranks with identical sample lists in one group, in order of their first rank."""
        loads = self.rank_loads(group, cost)
        members: Dict[Tuple[int, ...], List[int]] = {}
        for rank, ids in enumerate(self.sample_id_groups[group]):
            members.setdefault(tuple(ids), []).append(rank)
        return [PeerTeam(tuple(r), ids, loads[r[0]]) for ids, r in members.items()]


def _scheduler_class() -> type:
    """The upstream class; UserWarnings about missing TE/apex/absl at import are irrelevant here."""
    from megatron_dcp.integration.megatron_import import import_megatron_core

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if not import_megatron_core():
            raise PeerUnavailable("megatron-core is not installed or not importable")
        try:
            from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler
        except ImportError as error:
            raise PeerUnavailable(f"megatron-core has no hybrid-CP scheduler ({error})") from None
    return BalancedCPScheduler


def peer_available() -> bool:
    """True when megatron-core and its hybrid-CP scheduler can be imported."""
    try:
        _scheduler_class()
    except PeerUnavailable:
        return False
    return True


def schedule_peer(seqlens: Sequence[int], domain_size: int, budget: int) -> PeerSchedule:
    """Run the upstream scheduler on ``seqlens`` (sample id = index) over ``domain_size`` ranks."""
    scheduler = _scheduler_class()(budget, _DomainGroup(domain_size))
    start = time.perf_counter()
    _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(seqlens)), None)
    elapsed = time.perf_counter() - start
    groups = [[list(ids) for ids in group] for group in sample_id_groups]
    return PeerSchedule(tuple(seqlens), groups, elapsed)


def peer_report(schedule: PeerSchedule, domain: Domain, cost: CostModel) -> Report:
    """Score the peer's schedule with our cost model; see the module docstring."""
    groups = range(schedule.num_groups)
    tokens = [t for g in groups for t in schedule.rank_tokens(g)]
    passes = [sum(len(group[r]) for group in schedule.sample_id_groups) for r in range(domain.size)]
    histogram = Counter(c for g in groups for c in schedule.cp_sizes(g).values())
    return Report(
        scheduler=PEER_NAME,
        critical_path=sum(max(schedule.rank_loads(g, cost)) for g in groups),
        lower_bound=batch_lower_bound(schedule.seqlens, domain, cost),  # ours, without VPP
        num_microbatches=max(passes, default=0),
        max_tokens_per_rank=max(tokens, default=0.0),
        mean_tokens_per_rank=sum(tokens) / len(tokens) if tokens else 0.0,
        cp_size_histogram=dict(sorted(histogram.items())),
        plan_time_s=schedule.plan_time_s,
        num_groups=schedule.num_groups,
    )


def check_peer_input(seqlens: Sequence[int], domain: Domain) -> None:
    """Reject what the upstream scheduler would crash on (with a less clear message)."""
    domain.check_seqlens(seqlens)
    if any(seqlen == 0 for seqlen in seqlens):
        raise ValueError(f"{PEER_NAME} cannot schedule empty (0-token) sequences; drop them.")


def simulate_peer(
    seqlens: Sequence[int], domain: Domain, cost: CostModel
) -> Tuple[Report, PeerSchedule]:
    """Schedule with the peer and score it; raises :class:`PeerUnavailable` without megatron."""
    check_peer_input(seqlens, domain)
    schedule = schedule_peer(seqlens, domain.size, domain.budget)
    return peer_report(schedule, domain, cost), schedule


def _runs(ranks: Sequence[int]) -> List[Tuple[int, int]]:
    """Maximal contiguous runs of sorted ranks as (start, width)."""
    runs: List[Tuple[int, int]] = []
    for rank in ranks:
        if runs and runs[-1][0] + runs[-1][1] == rank:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((rank, 1))
    return runs


def peer_panel(schedule: PeerSchedule, domain: Domain, cost: CostModel, report: Report) -> Panel:
    """One row per group; each CP team (ranks running the same samples) drawn per contiguous run."""
    rows = []
    for group in range(schedule.num_groups):
        cells = [
            Cell(start, width, team.load, len(team.ranks))
            for team in schedule.teams(group, cost)
            for start, width in _runs(team.ranks)
        ]
        rows.append(tuple(sorted(cells, key=lambda cell: cell.start)))
    title = panel_title(report, f"groups, ≤{report.num_microbatches} passes per rank")
    return Panel(title, domain.size, tuple(rows), row_label="group (barrier-separated)")
