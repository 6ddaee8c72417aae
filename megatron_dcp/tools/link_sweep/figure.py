"""The sweep's picture: DCP's (and Megatron dev's) speedup over static CP against FLOPs per byte
of link (log x), measured with 95 % interval bars, one colour per workload, the model's predicted
DCP speedup as a dotted line, and marks where an H100 sits over NVLink and over InfiniBand."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_dcp.tools.link_sweep.runs import DEV, SweepRun, flops_per_byte
from megatron_dcp.tools.link_sweep.targets import H100_INFINIBAND, H100_NVLINK

CAPTION = (
    "FLOPs/byte = one rank's fp32 GEMM rate (model shapes, one thread) / the bytes/s it may send "
    "(probed rate / ranks sharing the shaped link). Marks: H100 SXM over NVLink 989e12 × 0.5 / "
    "450e9 B/s ≈ {nvlink:.2g}; over 400 Gb/s InfiniBand 494.5e12 / 50e9 B/s ≈ {ib:.2g}."
)
Series = Dict[str, List[Tuple[float, SweepRun]]]


def series_name(run: SweepRun) -> str:
    return run.workload + (f" ({run.link.nodes} nodes)" if run.link.nodes > 1 else "")


def placed(runs: Sequence[SweepRun], flops_per_s: Optional[float]) -> Series:
    """Every run with a known FLOPs per byte, by series, in increasing FLOPs per byte."""
    series: Series = {}
    for run in runs:
        ratio = flops_per_byte(run, flops_per_s)
        if ratio is not None:
            series.setdefault(series_name(run), []).append((ratio, run))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in series.items()}


def by_rate(points: List[Tuple[float, SweepRun]], value) -> Tuple[List[float], List[float]]:
    """Mean x and mean ``value(run)`` per link rate (repeats pooled), for the line."""
    groups: Dict[str, List[Tuple[float, float]]] = {}
    for x, run in points:
        y = value(run)
        if y is not None:
            groups.setdefault(run.link.rate, []).append((x, y))
    means = sorted((statistics.mean(x for x, _ in g), statistics.mean(y for _, y in g))
                   for g in groups.values())
    return [x for x, _ in means], [y for _, y in means]


def draw_arm(ax, points, arm: str, colour, style: str, label: str) -> None:
    measured = [(x, r.speedup[arm]) for x, r in points if arm in r.speedup]
    if not measured:
        return
    ax.errorbar(
        [x for x, _ in measured],
        [s.value for _, s in measured],
        yerr=[[s.value - s.low for _, s in measured], [s.high - s.value for _, s in measured]],
        fmt="o" if arm == "dcp" else "s", color=colour, capsize=3, alpha=0.9 if arm == "dcp" else 0.5,
    )
    xs, ys = by_rate(points, lambda r: r.speedup[arm].value if arm in r.speedup else None)
    ax.plot(xs, ys, style, color=colour, label=label, alpha=1.0 if arm == "dcp" else 0.5)


def plot_sweep(runs: Sequence[SweepRun], flops_per_s: Optional[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for index, (name, points) in enumerate(sorted(placed(runs, flops_per_s).items())):
        colour = f"C{index}"
        draw_arm(ax, points, "dcp", colour, "-", f"{name}: DCP")
        draw_arm(ax, points, DEV, colour, "--", f"{name}: Megatron dev")
        xs, ys = by_rate(points, lambda r: r.predicted.get("dcp"))
        ax.plot(xs, ys, ":", color=colour, linewidth=2, label=f"{name}: DCP predicted")
    for x, label in ((H100_NVLINK, "H100, NVLink"), (H100_INFINIBAND, "H100, 400 Gb/s IB")):
        ax.axvline(x, color="0.4", linewidth=1)
        ax.annotate(label, (x, 1.0), xytext=(3, 3), textcoords="offset points", rotation=90,
                    fontsize=8, color="0.3", va="bottom")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="FLOPs per byte of link (one rank)",
           ylabel="speedup over static CP (Σ static / Σ arm)",
           title="Speedup over static CP against link bandwidth, 95 % intervals")
    ax.legend(fontsize=7, ncol=2)
    fig.text(0.01, 0.01, CAPTION.format(nvlink=H100_NVLINK, ib=H100_INFINIBAND), fontsize=7,
             wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
