"""matplotlib is optional: without it, asking for a picture is a one-line error that
says what to install (and nothing else needs it)."""

import sys

import pytest

from megatron_dcp.tools.cli import main as cli
from megatron_dcp.tools.plot import (
    Cell,
    Panel,
    colour_range,
    plot_panels,
    require_matplotlib,
    row_fractions,
)


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError


def test_require_matplotlib_names_the_flag_and_the_install(no_matplotlib):
    with pytest.raises(ValueError, match=r"^--plot draws with matplotlib.*pip install matplotlib"):
        require_matplotlib()


def test_simulate_plot_without_matplotlib_is_one_line(no_matplotlib, tmp_path, capsys):
    argv = ["simulate", "--workload", "uniform", "--no-peer", "--plot", str(tmp_path / "p.png")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install matplotlib" in err
    assert not (tmp_path / "p.png").exists()


def test_simulate_without_plot_needs_no_matplotlib(no_matplotlib, capsys):
    assert cli.main(["simulate", "--workload", "uniform", "--no-peer"]) == 0


# The colour scale: a shared Normalize whose range holds every cell value of every panel (no cell
# clipped to an end of the scale), and every cell drawn with it.
LOW_CELLS = Panel("a", 4, ((Cell(0, 2, 10.0, 2), Cell(2, 1, 2.0, 1), Cell(3, 1, 4.0, 1)),))
HALF_CELLS = Panel("b", 4, ((Cell(0, 2, 5.0, 2), Cell(2, 2, 5.0, 2)), (Cell(0, 4, 3.0, 4),)))
IDLE_ROW = Panel("c", 2, ((Cell(0, 2, 0.0, 2),),))


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """Draw panels; return the Normalize instances made while drawing, and the figure."""
    import matplotlib.colors
    from matplotlib.figure import Figure

    norms, figures = [], []

    class RecordedNormalize(matplotlib.colors.Normalize):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            norms.append(self)

    monkeypatch.setattr(matplotlib.colors, "Normalize", RecordedNormalize)
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))

    def draw(panels):
        plot_panels(panels, str(tmp_path / "p.png"))
        return norms, figures[0]

    return draw


def test_the_colour_scale_holds_every_cell_of_every_panel(drawn):
    panels = [LOW_CELLS, HALF_CELLS, IDLE_ROW]
    values = [v for panel in panels for row in panel.rows for v in row_fractions(row)]
    assert sorted(set(values)) == [0.0, 0.2, 0.4, 1.0]
    norms, _ = drawn(panels)
    scales = [norm for norm in norms if norm.vmin is not None]  # not matplotlib's own, unset ones
    assert scales, "no colour scale made"
    for norm in scales:
        assert norm.vmin <= min(values) and max(values) <= norm.vmax
    assert colour_range(panels) == (0.0, 1.0)


def test_cells_of_different_load_get_different_colours(drawn):
    _, figure = drawn([LOW_CELLS])
    colours = [tuple(box.get_facecolor()) for box in figure.axes[0].patches]
    assert len(colours) == 3 and len(set(colours)) == 3  # 1, 0.2 and 0.4 of the slowest rank


def test_the_colour_scale_keeps_half_to_one_when_nothing_is_lower():
    assert colour_range([HALF_CELLS]) == (0.5, 1.0)
    assert colour_range([IDLE_ROW]) == (0.0, 1.0)  # an idle row: no zero-width scale


def test_the_position_axis_names_dp_cp_positions(drawn):
    _, figure = drawn([HALF_CELLS])
    assert figure.axes[0].get_xlabel() == "DP×CP position"
    assert "TP ranks share" in figure.get_supxlabel()  # said once, under the panels
