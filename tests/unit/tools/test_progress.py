"""Progress of long commands (``tools.progress``, drawn by tqdm): the clock starts at the first
finished item, so a long start-up counts neither as elapsed time nor in the estimate of what is
left; off a terminal, plain lines for the first item, then at most every interval, and always the
last; on a terminal tqdm's bar redrawn in place. Then each long command reporting through it:
fuzz, bench-train, calibrate, benchmark, the quick-start and the link sweep. tqdm's clock is
replaced by a fake one (``tqdm.std.time``, what tqdm reads the time with)."""

import argparse
import fcntl
import io
import os
import struct
import sys
import termios
import types

import pytest

from megatron_dcp.tools import benchmark_matrix
from megatron_dcp.tools.cli.main import main
from megatron_dcp.tools.progress import Progress, drawable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr("tqdm.std.time", fake)
    return fake


def test_the_estimate_comes_from_the_items_after_a_long_start_up(clock):
    """40 s of start-up before the first iteration, then one iteration a second: 2 s left after
    the third, not the 28 s that dividing the 42 s elapsed over 3 iterations would give."""
    out = io.StringIO()
    progress = Progress("quickstart: dcp", 5, "iterations", stream=out, every_s=0)
    for done, now in ((1, 40.0), (2, 41.0), (3, 42.0)):
        clock.now = now
        progress.update(done)
    assert out.getvalue().splitlines() == [
        "quickstart: dcp: 1/5 iterations, 00:00 elapsed, ? left",
        "quickstart: dcp: 2/5 iterations, 00:01 elapsed, 00:03 left",
        "quickstart: dcp: 3/5 iterations, 00:02 elapsed, 00:02 left",
    ]


def test_plain_lines_come_for_the_first_then_at_most_every_interval_and_at_the_end(clock):
    out = io.StringIO()
    progress = Progress("bench", 10, "steps", stream=out, every_s=30)
    for done in range(1, 11):
        clock.now = 10.0 * done
        progress.update(done, "arm dcp")
    assert out.getvalue().splitlines() == [
        "bench: 1/10 steps, 00:00 elapsed, ? left, arm dcp",
        "bench: 4/10 steps, 00:30 elapsed, 01:00 left, arm dcp",
        "bench: 7/10 steps, 01:00 elapsed, 00:30 left, arm dcp",
        "bench: 10/10 steps, 01:30 elapsed, 00:00 left, arm dcp",
    ]


def test_the_last_item_is_always_shown_and_only_once(clock):
    out = io.StringIO()
    progress = Progress("fuzz", 3, "cases", stream=out)
    for done in (1, 2, 3):
        clock.now = done
        progress.update(done)
    assert out.getvalue().splitlines() == [
        "fuzz: 1/3 cases, 00:00 elapsed, ? left",
        "fuzz: 3/3 cases, 00:02 elapsed, 00:00 left",
    ]
    out = io.StringIO()
    Progress("one", 1, stream=out).update(1)  # the first item is the last
    assert out.getvalue() == "one: 1/1, 00:00 elapsed, ? left\n"


def test_a_terminal_gets_tqdms_bar_redrawn_in_place(clock):
    out = Terminal()
    progress = Progress("fuzz", 2, "cases", stream=out)
    clock.now = 30.0  # start-up
    progress.update(1)
    clock.now = 31.0
    progress.update(2, "0 violations")
    text = out.getvalue()
    assert text.startswith("\rfuzz:  50%|") and text.endswith("\n") and text.count("\n") == 1
    assert "| 1/2 cases [00:00<?]" in text
    assert text.rstrip().endswith("| 2/2 cases [00:01<00:00, 0 violations]")


def test_a_terminal_without_a_width_gets_whole_plain_lines(clock, monkeypatch):
    """A pseudo-terminal opened without a size (``script``, a container run with ``-t``): tqdm
    would draw nothing there, and cut lines to its width of 0."""
    master, slave = os.openpty()
    os.set_blocking(master, False)  # nothing written: the read below fails instead of waiting
    with open(slave, "w") as tty, open(master, "rb", buffering=0) as screen:
        assert not drawable(tty)
        monkeypatch.setattr(sys, "stdout", tty)  # tqdm asks sys.stdout's terminal for its size
        Progress("fuzz", 1, "cases").update(1, "0 violations")
        assert screen.read(200) == b"fuzz: 1/1 cases, 00:00 elapsed, ? left, 0 violations\r\n"
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        assert drawable(tty)


def test_fuzz_reports_its_progress_off_a_terminal(capsys):
    assert main(["fuzz", "--cases", "20", "--seed", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fuzz: 1/20 cases, ") and lines[0].endswith("0 violations")
    assert lines[-2].startswith("fuzz: 20/20 cases, ")
    assert lines[-1] == "fuzz: 20 cases, 0 violations (seed 4)"


def test_bench_train_reports_each_iteration_it_reads_in_the_training_log(capsys):
    from megatron_dcp.tools.bench_train.run import iteration_progress

    read = iteration_progress(6, ("static", "dcp"))
    for iteration in range(1, 7):
        read("some megatron line\n")
        read(f" [DCP] iteration {iteration:8d} | micro-batches: 3 | ...\n")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bench-train: 1/6 iterations, ")
    assert lines[0].endswith("batch 1/3, arm static")
    assert lines[-1].startswith("bench-train: 6/6 iterations, ")
    assert lines[-1].endswith("batch 3/3, arm dcp")  # the turns rotate every batch
    assert len(lines) == 2  # off a terminal, the first, at most one line per 30 s, the last


def test_calibrate_reports_its_timed_passes_from_rank_0_only(capsys):
    from megatron_dcp.tools.calibration.rank_timing import TimingJob, _pass_progress

    job = TimingJob(points=("a", "b"), repeats=3, seed=0)
    reports = {rank: _pass_progress(rank, job) for rank in (0, 1)}
    for done in (1, 2, 3):
        reports[1](done)
    assert capsys.readouterr().out == ""
    for done in (1, 2, 3):
        reports[0](done)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "calibrate: 1/3 timed passes of 2 points",
        "calibrate: 3/3 timed passes of 2 points",
    ]


def test_benchmark_reports_its_cases_and_its_plan_time_runs_on_stderr(monkeypatch, capsys):
    """Each cost model's cases, then the plan-time runs; stdout keeps the tables (or the JSON)."""
    monkeypatch.setattr(
        benchmark_matrix, "evaluate", lambda *a, **k: types.SimpleNamespace(results=[])
    )
    monkeypatch.setattr(
        benchmark_matrix,
        "time_scheduler",
        lambda name, *a, **k: types.SimpleNamespace(scheduler=name),
    )
    args = argparse.Namespace(
        cost_model=["model", "latency"], cost_profile=None, workload=["1"], budget=[2048],
        vpp=[1, 2], ranks_per_node=None, seed=0, json=True, quick=True, max_timing_n=64,
    )  # fmt: skip
    benchmark_matrix.benchmark_comparisons(args)
    benchmark_matrix.benchmark_timings(args)
    out, err = capsys.readouterr()
    assert out == ""
    assert [line.split(",")[0] for line in err.splitlines()] == [
        "benchmark: cost model 'model': 1/2 cases",
        "benchmark: cost model 'model': 2/2 cases",
        "benchmark: cost model 'latency': 1/2 cases",
        "benchmark: cost model 'latency': 2/2 cases",
        "benchmark: plan time: 1/3 scheduler runs",
        "benchmark: plan time: 3/3 scheduler runs",
    ]


def test_the_quickstart_reports_each_runs_iterations(monkeypatch, capsys, tmp_path):
    from megatron_dcp.tools import quickstart

    def fake_run(flags, nproc, log, on_line=None):
        for iteration in (1, 2, 3):
            on_line(f" [DCP] iteration {iteration:8d} | micro-batches: 2 | ...\n")
        return "the run's log"

    monkeypatch.setattr(quickstart, "run_pretrain", fake_run)
    assert quickstart.train(quickstart.MODEL, "dp_balanced", 3, tmp_path) == "the run's log"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines[1:]] == [
        "quickstart: dp_balanced: 1/3 iterations",
        "quickstart: dp_balanced: 3/3 iterations",
    ]


def test_the_link_sweep_estimates_what_is_left_from_its_runs_times(tmp_path, capsys):
    """After each run scripts/bench_links.sh asks ``link-sweep --progress TOTAL``: runs done,
    their time (timings.txt) and the rest at their mean; the sweep's start is no run's time."""
    assert main(["link-sweep", str(tmp_path), "--progress", "4"]) == 0
    (tmp_path / "timings.txt").write_text("documents_unshaped 60 s\ndocuments_1gbit 120 s\n")
    assert main(["link-sweep", str(tmp_path), "--progress", "4"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "bench_links.sh: 0/4 runs, 00:00 elapsed, ? left",
        "bench_links.sh: 2/4 runs, 03:00 elapsed, 03:00 left",
    ]
