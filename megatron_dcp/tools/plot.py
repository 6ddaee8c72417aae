"""Plan pictures: one panel per scheduler, the DP×CP positions across (a position's TP ranks
share its column), micro-batches down, one outlined box per CP group, coloured by its per-rank
load relative to the slowest rank of its micro-batch (1 = on the critical path, darker = idle for
that fraction of the micro-batch), on one colour scale shared by the panels that spans every cell.
matplotlib (Agg) is optional (``pip install matplotlib``), imported only when
drawing; without it, asking for a picture is a one-line error that says what to install."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.metrics import rank_loads
from megatron_dcp.scheduling.plan import Plan
from megatron_dcp.tools.plan_report import Report

_PANEL_WIDTH_IN = 5.0
_MIN_LABEL_WIDTH_IN = 0.32
_CMAP = "viridis"
# Colour scale of load / slowest rank: what matters is 0.5–1, so the scale starts at 0.5 at the
# latest; it starts lower when a cell is lower (no cell is clipped to the end of the scale).
_VMIN = 0.5
POSITION_AXIS = "DP×CP position"
# Once under the panels (one per panel overlapped its neighbours).
POSITION_NOTE = "positions DP-major, CP inner; a position's TP ranks share its column"


@dataclass(frozen=True)
class Cell:
    """One CP group in one row: positions ``[start, start + width)``, per-rank load, CP size."""

    start: int
    width: int
    load: float
    cp_size: int


@dataclass(frozen=True)
class Panel:
    """One scheduler's schedule as rows of cells (a row = a micro-batch, or a peer's group)."""

    title: str
    domain_size: int
    rows: Tuple[Tuple[Cell, ...], ...]
    row_label: str = "micro-batch"


def panel_title(report: Report, rows: str = "micro-batches") -> str:
    """Scheduler, ratio to the lower bound and row count."""
    count = report.num_groups if report.num_groups is not None else report.num_microbatches
    return f"{report.scheduler}\ncritical path / lower bound {report.ratio:.3f} · {count} {rows}"


def plan_panel(plan: Plan, cost: CostModel, report: Report) -> Panel:
    """A panel of one of our plans: one row per micro-batch."""
    rows = []
    for microbatch in plan.microbatches:
        loads = rank_loads(plan, microbatch, cost)
        rows.append(
            tuple(Cell(g.ranks[0], g.size, loads[g.ranks[0]], g.size) for g in microbatch.groups)
        )
    return Panel(panel_title(report), plan.domain.size, tuple(rows))


def _text_colour(rgba: Sequence[float]) -> str:
    luminance = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]
    return "black" if luminance > 0.5 else "white"


def _draw_cell(ax: Any, cell: Cell, row: int, colour: Sequence[float], label: bool) -> None:
    from matplotlib.patches import Rectangle

    box = Rectangle((cell.start, row), cell.width, 1, facecolor=colour, edgecolor="black", lw=0.7)
    ax.add_patch(box)
    if label:
        ax.text(
            cell.start + cell.width / 2,
            row + 0.5,
            str(cell.cp_size),
            ha="center",
            va="center",
            fontsize=7,
            color=_text_colour(colour),
        )


def row_fractions(row: Sequence[Cell]) -> List[float]:
    """Each cell's per-rank load over the slowest rank of its row (all 0 in an idle row)."""
    slowest = max((cell.load for cell in row), default=0.0)
    return [cell.load / slowest if slowest else 0.0 for cell in row]


def colour_range(panels: Sequence[Panel]) -> Tuple[float, float]:
    """``(vmin, vmax)`` of the colour scale shared by ``panels``: from the smallest cell value (or
    :data:`_VMIN`, whichever is lower) to the largest (1 unless every row is idle), so that every
    cell of every panel lies on the scale and none is clipped to one of its ends."""
    values = [value for panel in panels for row in panel.rows for value in row_fractions(row)]
    high = max(values, default=0.0) or 1.0
    return min([_VMIN, *values]), high


def _draw_row(ax: Any, row: Sequence[Cell], index: int, colour_of: Any, min_label: float) -> None:
    """One micro-batch; loads are normalised to its slowest rank."""
    for cell, fraction in zip(row, row_fractions(row)):
        _draw_cell(ax, cell, index, colour_of(fraction), cell.width >= min_label)


def _set_axes(ax: Any, panel: Panel) -> None:
    rows = len(panel.rows)
    step = max(1, -(-rows // 20))
    ax.set_xlim(0, panel.domain_size)
    ax.set_ylim(rows, 0)
    ax.set_yticks([i + 0.5 for i in range(0, rows, step)], [str(i) for i in range(0, rows, step)])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.tick_params(labelsize=7, length=2)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel(POSITION_AXIS, fontsize=8)
    ax.set_ylabel(panel.row_label, fontsize=8)


def _draw_panel(ax: Any, panel: Panel, colour_of: Any) -> None:
    min_label = panel.domain_size * _MIN_LABEL_WIDTH_IN / _PANEL_WIDTH_IN
    min_label = min_label if len(panel.rows) <= 60 else float("inf")
    for index, row in enumerate(panel.rows):
        _draw_row(ax, row, index, colour_of, min_label)
    _set_axes(ax, panel)


def require_matplotlib(flag: str = "--plot") -> None:
    """Raise a one-line ValueError naming ``flag`` when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{flag} draws with matplotlib, which is not installed: pip install matplotlib."
        ) from None


def plot_panels(panels: Sequence[Panel], path: str, suptitle: str = "") -> None:
    """Draw ``panels`` side by side with one shared colour scale and colour bar."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    if not panels:
        raise ValueError("--plot: no scheduler produced a plan, nothing to draw.")
    scale = ScalarMappable(Normalize(*colour_range(panels)), plt.get_cmap(_CMAP))
    width = _PANEL_WIDTH_IN * len(panels) + 1.2
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _draw_panel(ax, panel, scale.to_rgba)
    bar = fig.colorbar(scale, ax=list(axes[0]), fraction=0.025)
    bar.set_label("per-rank load / slowest rank of the row (numbers: CP size)", fontsize=8)
    fig.supxlabel(POSITION_NOTE, fontsize=8, y=-0.04)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10, y=1.04)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
