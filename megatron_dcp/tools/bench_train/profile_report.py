"""The table ``bench-train --profile`` prints: where the busiest rank's step time goes, per arm.

It reads the attributions the workers wrote (``profile/<arm>_b<batch>_rank<r>.json``, made by
``profiling.attribute``) and the plans (``plans.jsonl``): for every profiled batch and arm, the
rank whose forward and backward steps took longest, its seconds per region (forward + backward),
and what that rank held: sequences, tokens, micro-batches. Figures are per profiled batch (the
mean over them); the ``per seq.`` column divides a region's time by the sequences the rank held,
which shows what scales with them when two arms hold different counts (a division, not a fit).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

from megatron_dcp.tools.bench_train.profiling import UNCLAIMED
from megatron_dcp.tools.bench_train.worker import PLANS_FILE, PROFILE_DIR, TRACE_PREFIX

HELD = (
    ("sequences held", "sequences"), ("tokens held", "tokens"), ("micro-batches", "microbatches")
)  # fmt: skip


@dataclass
class BusiestRank:
    """One arm's busiest rank, summed over the profiled batches."""

    batches: int = 0
    regions: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    held: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    wall_s: float = 0.0
    background_s: float = 0.0

    def add(self, record: dict, held: Dict[str, float]) -> None:
        self.batches += 1
        for key, seconds in record["main"].items():
            self.regions[key.rsplit("/", 1)[0]] += seconds
        for name, value in held.items():
            self.held[name] += value
        self.wall_s += record["wall_s"]
        self.background_s += sum(record["background"].values())

    def per_batch(self, held: str) -> float:
        """What the rank held per profiled batch (``sequences``, ``tokens``, ``microbatches``)."""
        return self.held[held] / self.batches

    def ms(self, region: str) -> float:
        """Milliseconds of ``region`` per profiled batch."""
        return 1e3 * self.regions.get(region, 0.0) / self.batches


def load_profiles(out: Path) -> Dict[Tuple[str, int], List[dict]]:
    """(arm, batch) → every rank's attribution record."""
    records: Dict[Tuple[str, int], List[dict]] = defaultdict(list)
    for path in sorted((out / PROFILE_DIR).glob("*_rank*.json")):
        if not path.name.startswith(TRACE_PREFIX):
            record = json.loads(path.read_text())
            records[(record["arm"], record["batch"])].append(record)
    return records


def step_seconds(record: dict) -> float:
    """The rank's main-thread seconds inside its forward and backward steps."""
    return sum(s for key, s in record["main"].items() if not key.startswith(UNCLAIMED + "/"))


def rank_holdings(out: Path) -> Dict[Tuple[str, int], List[Dict[str, float]]]:
    """(arm, batch) → per position: the sequences it holds (a CP group's every sequence at each
    of its ranks), its tokens and its micro-batches, from ``plans.jsonl``."""
    holdings: Dict[Tuple[str, int], List[Dict[str, float]]] = {}
    for line in (out / PLANS_FILE).read_text().splitlines():
        plan = json.loads(line)
        for arm, figures in plan["arms"].items():
            holdings[(arm, plan["batch"])] = [
                {
                    "sequences": len(position),
                    "tokens": sum(length / cp for length, cp in position),
                    "microbatches": figures["microbatches"],
                }
                for position in figures["sequences"]
            ]
    return holdings


def busiest(out: Path) -> Dict[str, BusiestRank]:
    """arm → its busiest rank of every profiled batch, summed."""
    holdings, arms = rank_holdings(out), {}
    for (arm, batch), records in sorted(load_profiles(out).items()):
        record = max(records, key=step_seconds)
        positions = holdings[(arm, batch)]
        arms.setdefault(arm, BusiestRank()).add(record, positions[record["rank"] % len(positions)])
    return arms


def attribution_lines(out: Path) -> List[str]:
    """The markdown table: one row per region (the costliest first), per arm its ms per batch
    and per held sequence; then what the rank held and the profiled calls' wall time."""
    arms = busiest(out)
    if not arms:
        return []
    regions = sorted({r for a in arms.values() for r in a.regions},
                     key=lambda r: -max(a.ms(r) for a in arms.values()))  # fmt: skip
    lines = ["| region | " + " | ".join(f"{arm} ms | per seq." for arm in arms) + " |"]
    lines.append("|---|" + "---:|---:|" * len(arms))
    for region in regions:
        cells = [f"{a.ms(region):.1f} | {a.ms(region) / a.per_batch('sequences'):.2f}"
                 for a in arms.values()]  # fmt: skip
        lines.append(f"| {region} | " + " | ".join(cells) + " |")
    for label, name in HELD:
        cells = [f"{a.per_batch(name):.1f} | " for a in arms.values()]
        lines.append(f"| *{label}* | " + " | ".join(cells) + " |")
    walls = [f"{1e3 * a.wall_s / a.batches:.0f} | " for a in arms.values()]
    lines.append("| *profiled call, wall ms* | " + " | ".join(walls) + " |")
    others = [f"{1e3 * a.background_s / a.batches:.1f} | " for a in arms.values()]
    lines.append("| *other threads' recorded ms* | " + " | ".join(others) + " |")
    return lines


def print_attribution(out: Path) -> None:
    """Print the table (nothing without profiles) and write it to ``profile/attribution.md``."""
    lines = attribution_lines(out)
    if not lines:
        return
    title = (
        "where the busiest rank's step goes (torch.profiler, bench-train --profile; ms per "
        "profiled batch, forward + backward; profiled steps are slower than timed ones):"
    )
    print("\n" + title)
    print("\n".join(lines))
    (out / PROFILE_DIR / "attribution.md").write_text(title + "\n\n" + "\n".join(lines) + "\n")
