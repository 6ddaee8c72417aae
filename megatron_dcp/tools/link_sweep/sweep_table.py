"""The link-rate sweep as one markdown table: per workload and link rate (one row per run),
the link, FLOPs per byte, the measured and predicted speedups, the model's error and order, and
each arm's distance to the limit, and the part of a step no plan changes (in the prediction)."""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron_dcp.tools.bench_train.stats import Interval
from megatron_dcp.tools.link_sweep.runs import DEV, SweepRun, flops_per_byte

ARMS = ("static", "dcp", DEV)
HEADER = (
    "| workload | rate | run | ranks | probed MB/s | FLOPs/byte | DCP over static [95 %] | "
    "dev over static [95 %] | DCP over dev [95 %] | predicted DCP (dev) over static | "
    "model error 5–30 | order, gap ≥ 10 % | measured / bound: static, DCP, dev | "
    "step rest ms |"
)


def show(value: Optional[Interval]) -> str:
    return "–" if value is None else f"{value.value:.3f} [{value.low:.3f}, {value.high:.3f}]"


def mb_per_s(run: SweepRun) -> str:
    link = run.link
    if link.probed_bytes_per_s:
        return f"{link.probed_bytes_per_s / 1e6:.1f}"
    if link.requested_bytes_per_s:
        return f"{link.requested_bytes_per_s / 1e6:.1f} (requested)"
    return "–"


def ranks(run: SweepRun) -> str:
    text = f"{run.nproc}" + (f" on {run.link.nodes} nodes" if run.link.nodes > 1 else "")
    return text + (" (oversubscribed)" if run.oversubscribed else "")


def row(run: SweepRun, flops_per_s: Optional[float]) -> str:
    ratio = flops_per_byte(run, flops_per_s)
    predicted = run.predicted
    guess = f"{predicted['dcp']:.3f}" if "dcp" in predicted else "–"
    if DEV in predicted:
        guess += f" ({predicted[DEV]:.3f})"
    error = "–" if run.model_error is None else f"{run.model_error:.1%}"
    bound = ", ".join(
        f"{run.distance[a]:.2f}" if a in run.distance else "–" for a in ARMS
    )
    cells = [
        run.workload,
        run.link.rate,
        run.tag or "1",
        ranks(run),
        mb_per_s(run),
        "–" if ratio is None else f"{ratio:.3g}",
        show(run.speedup.get("dcp")),
        show(run.speedup.get(DEV)),
        show(run.dcp_over_dev),
        guess,
        error,
        f"{run.clear_agree}/{run.clear_total}",
        bound,
        f"{run.remainder_s * 1e3:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(runs: Sequence[SweepRun], flops_per_s: Optional[float]) -> List[str]:
    separator = "|" + "---|" * (HEADER.count("|") - 1)
    return [HEADER, separator, *(row(run, flops_per_s) for run in runs)]
