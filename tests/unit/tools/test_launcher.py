"""A failed training run is reported by its cause: the last error line of its output and the log
that holds all of it (``tools.launching.training_runs``), as the quick-start shows it; the
quick-start refuses ``--iters 0`` up front and says why its runs have dropout 0."""

import io
import subprocess
import sys

import pytest

from megatron_dcp.tools import quickstart
from megatron_dcp.tools.launching import training_runs
from megatron_dcp.tools.launching.training_runs import DCPFigures, RunLog, TrainingRunError

CAUSE = "Exception: either train-iters or train-samples should be provided."
# The shape of a failed run's output (quickstart --iters 0): megatron's argument dump, each
# rank's traceback, then torchrun's summary, which does not hold the cause.
FAILED_RUN = "\n".join(
    [
        "  error_injection_rate ............................ 0",
        "  logits_load_ignore_errors ....................... False",
        *[
            line
            for rank in (1, 0)
            for line in (
                f"[rank{rank}]: Traceback (most recent call last):",
                f'[rank{rank}]:   File "megatron/training/arguments.py", line 9, in validate',
                f"[rank{rank}]:     raise Exception('either train-iters or train-samples ...')",
                f"[rank{rank}]: {CAUSE}",
            )
        ],
        "Traceback (most recent call last):",
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/",
        "============================================================",
    ]
)


@pytest.mark.parametrize(
    "text, line",
    [
        (FAILED_RUN, CAUSE),
        ("[rank0]: prog: error: argument --foo: bad\nend", "prog: error: argument --foo: bad"),
        ("ValueError: --max-seqlen-per-dp-cp-rank=7: bad\n[rank1]: KeyError", "KeyError"),
        ("iteration 1/ 5 | lm loss: 4.0\nall done", None),
    ],
)
def test_last_error_line(text, line):
    assert training_runs.last_error_line(text) == line


class FakeRun:
    """A finished torchrun: its output, read line by line, and its exit code."""

    def __init__(self, output: str, returncode: int) -> None:
        self.stdout, self.returncode, self.args = io.StringIO(output), returncode, ["torchrun"]

    def wait(self, timeout=None) -> int:
        return self.returncode

    def kill(self) -> None:
        pass


def fake_torchrun(monkeypatch, output: str, returncode: int = 1):
    monkeypatch.setattr(
        training_runs.subprocess, "Popen", lambda *args, **kwargs: FakeRun(output, returncode)
    )


def test_output_is_read_as_it_comes_and_a_run_past_its_time_is_killed():
    """``streamed``: every line reaches ``on_line`` and the output; a run past ``timeout_s`` is
    killed and ``TimeoutExpired`` carries what it printed (nothing is left running)."""
    seen = []
    code = "import sys, time; print('one', flush=True); print('two', flush=True)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert training_runs.streamed(process, 60, seen.append) == (0, "one\ntwo\n")
    assert seen == ["one\n", "two\n"]
    code = "import time; print('started', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        training_runs.streamed(process, 2, None)
    assert timeout.value.output == "started\n" and process.poll() is not None


def test_a_failed_run_names_its_log_and_its_cause(monkeypatch, tmp_path):
    fake_torchrun(monkeypatch, FAILED_RUN)
    log = tmp_path / "dp_balanced.log"
    with pytest.raises(TrainingRunError) as error:
        training_runs.run_pretrain([], 2, log)
    message = str(error.value)
    assert message.startswith(f"training exited with 1: {CAUSE}\n")
    assert str(log) in message and "ChildFailedError" not in message
    assert log.read_text() == FAILED_RUN


def test_without_a_log_or_an_error_line_the_tail_is_shown(monkeypatch, tmp_path):
    fake_torchrun(monkeypatch, FAILED_RUN)
    with pytest.raises(TrainingRunError, match="the last 40 lines of its output") as error:
        training_runs.run_pretrain([], 2)
    assert str(error.value).startswith(f"training exited with 1: {CAUSE}")
    fake_torchrun(monkeypatch, "killed\n" * 50, returncode=-9)
    with pytest.raises(TrainingRunError) as error:
        training_runs.run_pretrain([], 2, tmp_path / "run.log")
    assert f"(all of it in {tmp_path / 'run.log'})" in str(error.value)
    assert str(error.value).count("killed") == 40


@pytest.mark.parametrize("iters", ["0", "-3", "two"])
def test_quickstart_refuses_a_bad_iteration_count_up_front(monkeypatch, capsys, tmp_path, iters):
    def no_training(*args):
        raise AssertionError("the quick-start trained")

    monkeypatch.setattr(quickstart, "train", no_training)
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main(["--iters", iters, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "argument --iters" in capsys.readouterr().err


def quiet_quickstart(monkeypatch, train):
    monkeypatch.setattr(quickstart, "require_matplotlib", lambda what: None)
    monkeypatch.setattr(quickstart, "train", train)


def test_quickstart_reports_the_failed_runs_cause(monkeypatch, capsys, tmp_path):
    def failing(model, scheduler, iters, out):
        raise TrainingRunError(f"training exited with 1: {CAUSE}\n(the last error line of x)")

    quiet_quickstart(monkeypatch, failing)
    assert quickstart.main(["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"quickstart: error: training exited with 1: {CAUSE}")


def test_quickstart_says_why_dropout_is_off(monkeypatch, capsys, tmp_path):
    figures = DCPFigures(3, {1: 4}, 1.0, 1.1, 1.2, 100)

    def trained(model, scheduler, iters, out):
        return RunLog(losses={1: 4.0, 2: 3.0}, dcp={1: figures, 2: figures})

    quiet_quickstart(monkeypatch, trained)
    made = dict.fromkeys(quickstart.SCHEDULERS)
    monkeypatch.setattr(quickstart, "replan", lambda model, iters: (None, [made] * iters))
    monkeypatch.setattr(quickstart, "ran_as_replanned", lambda figures, plan: True)
    monkeypatch.setattr(quickstart, "ratio_to_bound", lambda plan, cost: 1.0)
    monkeypatch.setattr(quickstart, "plot_first_plans", lambda plans, cost, path: None)
    assert quickstart.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "dropout is 0 in both runs" in out and "about 1e-4 relative" in out
    assert quickstart.MODEL["--hidden-dropout"] == 0.0
