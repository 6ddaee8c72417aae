"""Progress lines of long commands (``tools.progress``): off a terminal, plain lines at most
every interval and always the last, with the elapsed time and an estimate of what is left; on
a terminal one line rewritten in place; and ``megatron-dcp fuzz`` reporting through it."""

import io

from megatron_dcp.tools.cli.main import main
from megatron_dcp.tools.progress import Progress, duration


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_come_at_most_every_interval_and_always_at_the_end():
    out, clock = io.StringIO(), Clock()
    progress = Progress("bench", 10, "steps", stream=out, every_s=30, clock=clock)
    for done in range(1, 11):
        clock.now = 10.0 * done
        progress.update(done, "arm dcp")
    lines = out.getvalue().splitlines()
    assert lines == [
        "bench: 1/10 steps, 10 s, ~1 min 30 s left, arm dcp",
        "bench: 4/10 steps, 40 s, ~1 min 0 s left, arm dcp",
        "bench: 7/10 steps, 1 min 10 s, ~30 s left, arm dcp",
        "bench: 10/10 steps, 1 min 40 s, arm dcp",
    ]


def test_a_terminal_line_is_rewritten_in_place():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, clock = Terminal(), Clock()
    progress = Progress("fuzz", 2, stream=out, clock=clock)
    progress.update(1)
    clock.now = 1.0
    progress.update(2)
    assert out.getvalue() == "\r\033[Kfuzz: 1/2, 0 s, ~0 s left\r\033[Kfuzz: 2/2, 1 s\n"


def test_durations_read_in_the_largest_units():
    assert [duration(s) for s in (42, 185, 3720)] == ["42 s", "3 min 5 s", "1 h 2 min"]


def test_fuzz_reports_its_progress_off_a_terminal(capsys):
    assert main(["fuzz", "--cases", "20", "--seed", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fuzz: 1/20 cases, ") and lines[0].endswith("0 violations")
    assert lines[-2].startswith("fuzz: 20/20 cases, ")
    assert lines[-1] == "fuzz: 20 cases, 0 violations (seed 4)"


def test_bench_train_reports_each_iteration_it_reads_in_the_training_log(capsys):
    from megatron_dcp.tools.cli.bench_train import iteration_progress

    read = iteration_progress(6, ("static", "dcp"))
    for iteration in range(1, 7):
        read("some megatron line\n")
        read(f" [DCP] iteration {iteration:8d} | micro-batches: 3 | ...\n")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bench-train: 1/6 iterations, ")
    assert lines[0].endswith("batch 1/3, arm static")
    assert lines[-1].startswith("bench-train: 6/6 iterations, ")
    assert lines[-1].endswith("batch 3/3, arm dcp")  # the turns rotate every batch
    assert len(lines) == 2  # off a terminal, at most one line per 30 s and the last
