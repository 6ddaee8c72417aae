"""The table ``bench-train --profile`` prints: where the busiest rank's step time goes, per arm.

It reads the attributions the workers wrote (``profile/<arm>_b<batch>_rank<r>.json``, made by
``profiling.attribute``) and the plans (``plans.jsonl``): for every profiled batch and arm, the
rank whose forward and backward steps took longest, its seconds per region (forward + backward,
summed over the profiled batches), and what that rank held: sequences, tokens, micro-batches.
Dividing a region's time by those counts shows what it scales with (the report's ``per
sequence`` and ``per 1k tokens`` columns are that division, not a fit).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

from megatron_dcp.tools.bench_train.profiling import UNCLAIMED
from megatron_dcp.tools.bench_train.worker import PLANS_FILE, PROFILE_DIR, TRACE_PREFIX

Attribution = Dict[str, float]  # "region/direction" -> seconds


def load_profiles(out: Path) -> Dict[Tuple[str, int], List[dict]]:
    """(arm, batch) → every rank's attribution record."""
    records: Dict[Tuple[str, int], List[dict]] = defaultdict(list)
    for path in sorted((out / PROFILE_DIR).glob("*_rank*.json")):
        if path.name.startswith(TRACE_PREFIX):
            continue
        record = json.loads(path.read_text())
        records[(record["arm"], record["batch"])].append(record)
    return records


def step_seconds(record: dict) -> float:
    """The rank's main-thread seconds inside its forward and backward steps."""
    return sum(s for key, s in record["main"].items() if not key.startswith(UNCLAIMED + "/"))


def rank_holdings(out: Path) -> Dict[Tuple[str, int], List[Dict[str, float]]]:
    """(arm, batch) → per position: the sequences it holds (a CP group's sequence counts at
    each of its ranks), its tokens and its micro-batches, from ``plans.jsonl``."""
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


def busiest(out: Path) -> Dict[str, dict]:
    """arm → the busiest rank's attribution summed over the profiled batches, with its
    holdings summed alike and the profiled calls' wall seconds."""
    holdings, arms = rank_holdings(out), {}
    for (arm, batch), records in sorted(load_profiles(out).items()):
        record = max(records, key=step_seconds)
        held = holdings[(arm, batch)][record["rank"] % len(holdings[(arm, batch)])]
        summary = arms.setdefault(arm, {"regions": defaultdict(float), "batches": 0, "wall_s": 0.0,
                                        "sequences": 0, "tokens": 0.0, "microbatches": 0})  # fmt: skip
        for key, seconds in record["main"].items():
            summary["regions"][key.rsplit("/", 1)[0]] += seconds
        summary["background_s"] = summary.get("background_s", 0.0) + sum(record["background"].values())
        summary["batches"] += 1
        summary["wall_s"] += record["wall_s"]
        for name in ("sequences", "tokens", "microbatches"):
            summary[name] += held[name]
    return arms


def attribution_lines(out: Path) -> List[str]:
    """The markdown table: one row per region, per arm its ms per batch and per held sequence."""
    arms = busiest(out)
    if not arms:
        return []
    names = list(arms)
    regions = sorted({r for a in arms.values() for r in a["regions"]},
                     key=lambda r: -max(a["regions"].get(r, 0.0) for a in arms.values()))  # fmt: skip
    head = "| region | " + " | ".join(f"{arm} ms | per seq. ms" for arm in names) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(names)]
    for region in regions:
        cells = []
        for arm in names:
            a = arms[arm]
            ms = 1e3 * a["regions"].get(region, 0.0) / a["batches"]
            cells.append(f"{ms:.1f} | {ms * a['batches'] / a['sequences']:.2f}")
        lines.append(f"| {region} | " + " | ".join(cells) + " |")
    for label, name in (("sequences held", "sequences"), ("tokens held", "tokens"),
                        ("micro-batches", "microbatches")):  # fmt: skip
        cells = [f"{arms[arm][name] / arms[arm]['batches']:.1f} | " for arm in names]
        lines.append(f"| *{label}* | " + " | ".join(cells) + " |")
    walls = [f"{1e3 * arms[arm]['wall_s'] / arms[arm]['batches']:.0f} | " for arm in names]
    lines.append("| *profiled call, wall ms* | " + " | ".join(walls) + " |")
    background = [f"{1e3 * arms[arm]['background_s'] / arms[arm]['batches']:.1f} | " for arm in names]
    lines.append("| *other threads' recorded ms* | " + " | ".join(background) + " |")
    return lines


def print_attribution(out: Path) -> None:
    """Print the table (nothing without profiles) and write it to ``profile/attribution.md``."""
    lines = attribution_lines(out)
    if not lines:
        return
    title = ("where the busiest rank's step goes (torch.profiler, bench-train --profile; ms per "
             "profiled batch, forward + backward):")  # fmt: skip
    print("\n" + title)
    print("\n".join(lines))
    (out / PROFILE_DIR / "attribution.md").write_text(title + "\n\n" + "\n".join(lines) + "\n")
