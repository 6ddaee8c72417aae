"""Start-up errors of ``megatron_dcp.pretrain_gpt`` as a user sees them: a
refused DCP setting is one line from rank 0, before megatron's argument dump, the last line the
worker prints, with no traceback, and under torchrun the root cause of torchrun's failure summary
(the last block it prints); a typo in a flag or a choice prints argparse's one line with "did you
mean" and the DCP flags' usage, not megatron's 1,500 lines. The torchrun launch keeps Python's
warnings on, as a user has them: on CPU megatron's warnings that Transformer Engine and Apex are
missing are not among them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.tools.launching.training_runs import flag_list, worker_env

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

ARGUMENT_DUMP = "------------------------ arguments"
# A tiny model; each run below is refused before it is built.
TINY = {
    "--dynamic-context-parallel": True,
    "--max-seqlen-per-dp-cp-rank": 128,
    "--num-layers": 1,
    "--hidden-size": 32,
    "--num-attention-heads": 4,
    "--seq-length": 128,
    "--max-position-embeddings": 256,
    "--micro-batch-size": 1,
    "--global-batch-size": 2,
    "--train-iters": 1,
    "--lr": 1e-3,
    "--tokenizer-type": "NullTokenizer",
    "--vocab-size": 128,
}
TOO_LARGE_MIN_CP = (
    "error: --min-dynamic-context-parallel-size=4: must be a power of two between 1 and the "
    "DP×CP domain size 2 (dp 1 × cp 2); use 1 or 2."
)


# Python's warnings as a user has them (worker_env turns them off), but for megatron's notice that
# absl is missing (not about Transformer Engine or Apex, so shown on CPU too).
WARNINGS_ON = {**worker_env(), "PYTHONWARNINGS": "ignore:absl.logging is not installed"}
MISSING_TE_APEX = ("Transformer Engine and Apex are not installed", "Apex is not", "MoE experts")
ROOT_CAUSE = "Root Cause (first observed failure):\n"


def root_cause(summary: str) -> str:
    """The root-cause block of torchrun's failure summary, which must be the last thing printed:
    from its heading to the closing rule (the last line)."""
    _, heading, block = summary.rpartition(ROOT_CAUSE)
    lines = block.splitlines()
    assert heading and lines and set(lines[-1]) == {"="}, summary[-2000:]
    return "\n".join(lines[:-1])


def worker_files(log_dir: Path) -> dict:
    """(local rank, "stdout" | "stderr") -> what that worker printed (torchrun --redirects 3)."""
    files = {}
    for path in log_dir.glob("*/attempt_0/*/std*.log"):
        files[int(path.parent.name), path.stem] = path.read_text()
    return files


def test_a_refused_dcp_flag_is_one_line_from_rank_0_and_torchruns_root_cause(tmp_path):
    """torchrun, 2 ranks, --min-dynamic-context-parallel-size larger than the DP×CP domain: rank 0
    prints the cause and nothing else (no warning that Transformer Engine or Apex is missing),
    rank 1 prints nothing, no worker prints a traceback or megatron's argument dump; the root
    cause of torchrun's summary, the last block it prints, is rank 0 with exit status 2 and the
    cause's line."""
    flags = {**TINY, "--context-parallel-size": 2, "--min-dynamic-context-parallel-size": 4}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [f"--log-dir={tmp_path / 'logs'}", "--redirects=3"]
    command += ["-m", "megatron_dcp.pretrain_gpt", *flag_list(flags)]
    done = subprocess.run(
        command, env=WARNINGS_ON, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode != 0
    files = worker_files(tmp_path / "logs")
    assert sorted(files) == [(0, "stderr"), (0, "stdout"), (1, "stderr"), (1, "stdout")]
    everything = "".join(files.values())
    assert "Traceback" not in everything
    assert ARGUMENT_DUMP not in everything
    assert not any(warning in everything for warning in MISSING_TE_APEX)
    assert everything.count("--min-dynamic-context-parallel-size=4") == 1
    # Nothing on rank 0's stdout: the last line of its stderr is the last line it printed.
    assert files[0, "stdout"] == "" and files[0, "stderr"].splitlines() == [TOO_LARGE_MIN_CP]
    assert files[1, "stdout"] == files[1, "stderr"] == ""
    cause = root_cause(done.stderr)
    assert "rank      : 0 (local_rank: 0)" in cause and "exitcode  : 2 " in cause
    assert cause.endswith(f"traceback : {TOO_LARGE_MIN_CP}")


def test_a_refused_model_setting_is_the_last_line_before_megatron_prints_anything(tmp_path):
    """One process (no launcher: stdout and stderr in one pipe, in the order they were written):
    a model setting DCP refuses (compat.check_model_config) stops start-up before megatron's
    argument dump and before the model is built, as the only line."""
    flags = {**TINY, "--recompute-granularity": "selective", "--recompute-modules": "mlp"}
    command = [sys.executable, "-m", "megatron_dcp.pretrain_gpt", *flag_list(flags)]
    done = subprocess.run(
        command,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
        check=False,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 2
    assert "Traceback" not in done.stdout and ARGUMENT_DUMP not in done.stdout
    assert lines[-1].startswith("error: --dynamic-context-parallel with --recompute-modules mlp")
    assert lines == lines[-1:]


@pytest.fixture(scope="module")
def pretrain_gpt():
    from megatron_dcp import pretrain_gpt

    return pretrain_gpt


def start_with(pretrain_gpt, *flags: str) -> int:
    """The status the entry point's start-up exits with for ``flags`` (after TINY's)."""
    with pytest.raises(SystemExit) as exit_:
        pretrain_gpt.start(
            [*flag_list(TINY), *flags], pretrain_gpt.check_args, pretrain_gpt.gpt_config_from_args
        )
    return exit_.value.code


@pytest.mark.parametrize(
    "flags,error",
    [
        (
            ["--sequence-packing-scheduler", "defualt_dynamic_cp"],
            "invalid choice: 'defualt_dynamic_cp' (choose from 'default_dynamic_cp', "
            "'dp_balanced'); did you mean 'default_dynamic_cp'?",
        ),
        (["--dcp-hardware-profile", "h100-nvlnk"], "did you mean 'h100-nvlink'?"),
        (["--dcp-prefetch", "yes"], "invalid choice: 'yes' (choose from 'on', 'off')"),
        (
            ["--sequence-packing-schedular", "dp_balanced"],
            "unrecognized arguments: --sequence-packing-schedular dp_balanced; did you mean "
            "--sequence-packing-scheduler?",
        ),
        (["--transformer-impl", "locl"], "did you mean 'local'?"),  # one of megatron's flags
    ],
)
def test_b_a_typo_is_one_error_line_after_the_dcp_flags_usage(pretrain_gpt, capsys, flags, error):
    assert start_with(pretrain_gpt, *flags) == 2
    printed = capsys.readouterr()
    lines = printed.err.splitlines()
    assert printed.out == "" and len(lines) < 40
    assert lines[0].startswith("usage: ") and "--sequence-packing-scheduler" in printed.err
    assert lines[-1].endswith(error) and ": error: " in lines[-1]
    assert error.endswith("?") or "did you mean" not in lines[-1]


def test_b_only_rank_0_prints_a_typo(pretrain_gpt, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("megatron_dcp.integration.training.startup_errors.RANK0_GRACE_S", 0.0)
    assert start_with(pretrain_gpt, "--dcp-hardware-profile", "h100-nvlnk") == 2
    assert capsys.readouterr() == ("", "")


def test_b_each_nodes_first_worker_gives_torchrun_the_error_line(
    pretrain_gpt, capsys, monkeypatch, tmp_path
):
    """A typo, refused in-process as a worker would be: the worker with LOCAL_RANK 0 (rank 0, or
    the first of another node) writes its line to TORCHELASTIC_ERROR_FILE, where torch's failure
    summary reads it as the root cause, ahead of a rank that torchrun stopped; the others write
    nothing."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr("megatron_dcp.integration.training.startup_errors.RANK0_GRACE_S", 0.0)
    written = {}
    for rank, local_rank in (("1", "1"), ("2", "0"), ("0", "0")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert start_with(pretrain_gpt, "--dcp-hardware-profile", "h100-nvlnk") == 2
        written[rank] = error_file.exists() and error_file.read_text()
        error_file.unlink(missing_ok=True)
    assert written["1"] is False and written["0"] and written["2"]
    # The same line (the timestamps may fall in different seconds).
    assert json.loads(written["2"])["message"]["message"] == (
        json.loads(written["0"])["message"]["message"]
    )
    error_file.write_text(written["0"])
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.endswith("did you mean 'h100-nvlink'?")
    stopped = ProcessFailure(local_rank=1, pid=2, exitcode=-15, error_file=str(tmp_path / "none"))
    refused = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    # In the order torchrun sees them fail: rank 0 exits, then torchrun stops rank 1.
    summary = ChildFailedError("megatron_dcp.pretrain_gpt", {0: refused, 1: stopped}).format_msg()
    assert refused.timestamp <= stopped.timestamp
    cause = root_cause(summary)
    assert "rank      : 0 (local_rank: 0)" in cause and cause.endswith(f"traceback : {line}")


def test_help_lists_every_flag_despite_megatrons_percent_sign(pretrain_gpt, capsys):
    """megatron-core 0.19.2's --help fails on a help text with a bare "%"; ours prints it."""
    assert start_with(pretrain_gpt, "--help") == 0
    out = capsys.readouterr().out
    assert "(e.g. 1.10 = 10%)" in out and "--dcp-cost-adapt" in out and "--num-layers" in out


def test_held_output_is_shown_when_start_up_passes_and_dropped_when_refused(capfd):
    from megatron_dcp.integration.training.startup_errors import held_stdout, startup_checks

    with held_stdout():
        print("the argument dump")
    with pytest.raises(AssertionError), held_stdout():
        print("megatron's own refusal keeps what came before it")
        raise AssertionError
    with pytest.raises(SystemExit) as exit_, startup_checks(), held_stdout():
        print("the argument dump of a refused run")
        raise ValueError("--flag=1: the cause")
    printed = capfd.readouterr()
    assert printed.out.splitlines() == [
        "the argument dump",
        "megatron's own refusal keeps what came before it",
    ]
    assert printed.err == "error: --flag=1: the cause\n" and exit_.value.code == 2
