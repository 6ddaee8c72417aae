"""matplotlib is an optional extra: without it, asking for a picture is a one-line error that
says what to install (and nothing else needs it)."""

import sys

import pytest

from megatron_dcp.tools import cli
from megatron_dcp.tools.plot import require_matplotlib


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError


def test_require_matplotlib_names_the_flag_and_the_extra(no_matplotlib):
    with pytest.raises(ValueError, match=r"^--plot draws with matplotlib.*megatron-dcp\[plot\]"):
        require_matplotlib()


def test_simulate_plot_without_matplotlib_is_one_line(no_matplotlib, tmp_path, capsys):
    argv = ["simulate", "--workload", "uniform", "--no-peer", "--plot", str(tmp_path / "p.png")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'megatron-dcp[plot]'" in err
    assert not (tmp_path / "p.png").exists()


def test_simulate_without_plot_needs_no_matplotlib(no_matplotlib, capsys):
    assert cli.main(["simulate", "--workload", "uniform", "--no-peer"]) == 0
