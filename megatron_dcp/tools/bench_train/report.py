"""The ``bench-train`` report: a table on the terminal, ``bench_train.json`` (every step and
every summary) and ``bench_train.png`` (step time per batch per arm; speedups with intervals)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

from megatron_dcp.tools.bench_train.results import BenchResult
from megatron_dcp.tools.bench_train.stats import CLEAR_GAP, LEVEL
from megatron_dcp.tools.link.rate import megabytes

JSON_FILE = "bench_train.json"
PNG_FILE = "bench_train.png"


def describe_run(result: BenchResult) -> str:
    compared = len({s.batch for s in result.steps}) - result.warmup
    cores = "OVERSUBSCRIBED: ranks share cores" if result.oversubscribed else "one rank per core"
    return (
        f"{result.nproc} ranks ({cores}); {compared} global batches compared per arm, "
        f"{result.warmup} warm-up left out; intervals {LEVEL:.0%} (bootstrap over batches)"
        + describe_link(result.link)
    )


def describe_link(link: Optional[Dict[str, object]]) -> str:
    """``; link 200mbit requested (25.0 MB/s), probed 25.1 MB/s`` and, on two nodes, where."""
    if link is None:
        return ""
    where = "shaped loopback, one node"
    if link["nodes"] > 1:
        where = (
            f"veth between {link['nodes']} nodes; inside a node "
            f"{megabytes(link['loopback_bytes_per_s'])}"
        )
    return (
        f"; link {link['requested']} requested ({megabytes(link['requested_bytes_per_s'])}), "
        f"probed {megabytes(link['probed_bytes_per_s'])} ({where})"
    )


def table(result: BenchResult) -> List[str]:
    rows = [
        f"{'arm':<13} {'step ms (median, CI)':<24} {'speedup vs static':<22} {'tokens/s':>8} "
        f"{'mb':>5} {'CP sizes':<16} {'plan ms':>7} {'pred ms':>8} {'fwd-bwd ms':>10} "
        f"{'CP/LB':>5}"
    ]
    for arm in result.arms:
        s = result.summaries[arm]
        step = f"{s.step_ms.value:.1f} [{s.step_ms.low:.1f}, {s.step_ms.high:.1f}]"
        speedup = "1 (baseline)"
        if s.speedup is not None:
            speedup = f"{s.speedup.value:.3f} [{s.speedup.low:.3f}, {s.speedup.high:.3f}]"
        sizes = " ".join(f"{c}:{n}" for c, n in s.cp_sizes.items())
        rows.append(
            f"{arm:<13} {step:<24} {speedup:<22} {s.tokens_per_s:>8.0f} {s.microbatches:>5.1f} "
            f"{sizes:<16} {s.plan_time_ms:>7.1f} {s.predicted_ms:>8.1f} {s.fwd_bwd_ms:>10.1f} "
            f"{s.ratio_to_bound:>5.3f}"
        )
    return rows


def model_lines(result: BenchResult) -> List[str]:
    errors = ", ".join(f"iterations {w} {e:.1%}" for w, e in result.errors.items())
    o = result.ordering
    return [
        "model vs clock: [DCP] predicted fwd-bwd against measured, median error: "
        + (errors or "n/a"),
        f"plan order (critical path vs step time), predicted gap ≥ {CLEAR_GAP:.0%}: "
        f"{o.clear_agree}/{o.clear_total} agree; below: {o.close_agree}/{o.close_total} agree",
    ]


def print_report(result: BenchResult) -> None:
    lines = ["", describe_run(result), *table(result)]
    lines += [
        f"dcp over {arm} (paired): {s.value:.3f} [{s.low:.3f}, {s.high:.3f}]"
        for arm, s in result.dcp_over.items()
    ]
    lines += model_lines(result)
    lines += [f"n/a {arm}: {why}" for arm, why in result.unavailable.items()]
    print("\n".join(lines))


def write_outputs(result: BenchResult, out: Path) -> None:
    (out / JSON_FILE).write_text(json.dumps(asdict(result), indent=1, default=str))
    written = [str(out / JSON_FILE)]
    try:
        plot(result, out / PNG_FILE)
        written.append(str(out / PNG_FILE))
    except ImportError:
        print("bench-train: no picture (matplotlib is missing: pip install matplotlib)")
    print(f"bench-train: wrote {', '.join(written)}; the training log is {out / 'train.log'}")


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm in result.arms:
        steps = sorted((s for s in result.steps if s.arm == arm), key=lambda s: s.batch)
        left.plot([s.batch for s in steps], [s.step_ms for s in steps], marker="o", label=arm)
    left.axvspan(-0.5, result.warmup - 0.5, color="0.9", label="warm-up (left out)")
    left.set(xlabel="global batch", ylabel="step time (ms)", title="step time per batch")
    left.legend()
    others = [a for a in result.arms if result.summaries[a].speedup is not None]
    speedups = [result.summaries[a].speedup for a in others]
    right.bar(others, [s.value for s in speedups], color="tab:blue")
    right.errorbar(
        others,
        [s.value for s in speedups],
        yerr=[[s.value - s.low for s in speedups], [s.high - s.value for s in speedups]],
        fmt="none",
        ecolor="black",
        capsize=6,
    )
    for x, interval in zip(others, speedups):
        right.annotate(f"{interval.value:.3f}", (x, interval.high), ha="center", va="bottom")
    right.set_ylim(min([1.0, *(s.low for s in speedups)]) - 0.05,
                   max([1.0, *(s.high for s in speedups)]) + 0.05)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set(ylabel="speedup over static CP (Σ static / Σ arm)", title=f"{LEVEL:.0%} intervals")
    fig.suptitle(describe_run(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
