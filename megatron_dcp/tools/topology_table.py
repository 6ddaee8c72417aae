"""The benchmark's topology table: on each case, our scheduler planning with one link tier (blind
to the nodes) and with two (intra- and inter-node), both plans judged under the two-tier cost
(what the job would really pay), with the CP groups that cross a node boundary counted."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from megatron_dcp.scheduling import CostModel, build_scheduler
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
from megatron_dcp.scheduling.topology import crossing_groups
from megatron_dcp.tools.compare import DomainSpec, render_table, scheduler_kwargs

OURS = "default_dynamic_cp"


@dataclass(frozen=True)
class TierRow:
    """One case: (critical path / two-tier bound, crossing groups, micro-batches) per plan."""

    title: str
    one_tier: Tuple[float, int, int]
    two_tier: Tuple[float, int, int]


def tier_row(title: str, lengths: Sequence[int], spec: DomainSpec, cost: CostModel) -> TierRow:
    """Plan ``lengths`` blind to the nodes and over them; judge both under the two-tier cost."""
    priced = spec.priced(cost)
    figures = []
    for planning in (cost.with_nodes(None), priced):
        plan = build_scheduler(OURS, **scheduler_kwargs(spec, planning)).schedule(lengths)
        ratio = critical_path(plan, priced) / lower_bound(plan, priced)
        figures.append((ratio, crossing_groups(plan, priced.nodes), plan.num_microbatches))
    return TierRow(title, figures[0], figures[1])


def format_tier_table(label: str, ranks_per_node: int, rows: Sequence[TierRow]) -> str:
    """One line per case and a summary: how often, and by how much, two tiers plan better."""
    header = ("case", "one tier CP/LB", "crossing", "(mb)", "two tiers CP/LB", "crossing", "(mb)")
    cells: List[Tuple[str, ...]] = []
    gains = []
    for row in rows:
        gains.append(row.one_tier[0] / row.two_tier[0])
        cells.append((row.title, *_cells(row.one_tier), *_cells(row.two_tier)))
    better = sum(gain > 1 + 1e-9 for gain in gains)
    worse = sum(gain < 1 - 1e-9 for gain in gains)
    summary = (
        f"two tiers shorter in {better}/{len(rows)}, longer in {worse}; one-tier/two-tier "
        f"critical path: mean {statistics.mean(gains):.3f}, best {max(gains):.3f}"
        if rows
        else "no case"
    )
    title = (
        f"== topology, cost model '{label}', {ranks_per_node} ranks per node: both plans judged "
        "under the two-tier cost (CP/LB, groups crossing nodes, micro-batches)"
    )
    return "\n".join([title, render_table(header, cells, "lrrrrrr"), summary])


def _cells(figures: Tuple[float, int, int]) -> Tuple[str, str, str]:
    ratio, crossing, microbatches = figures
    return f"{ratio:.3f}", str(crossing), f"({microbatches})"
