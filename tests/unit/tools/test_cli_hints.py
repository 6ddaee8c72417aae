"""Hints that compute from the whole input: the budget a too-long batch needs (from its longest
sample, rounded to what training accepts), the CP sizes a domain offers, and the reason for
every n/a cell of the benchmark."""

import re

import pytest

from megatron_dcp.scheduling import build_scheduler
from megatron_dcp.scheduling.domain import Domain, budget_multiple, least_budget, size_choices
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.tools import compare
from megatron_dcp.tools.cli import main as cli

# The issue's command: its first hint (1385, from the first sample that does not fit) failed
# again with 1385, which is also odd.
ISSUE_SIMULATE = ["simulate", "--workload", "lognormal", "--dp-size", "1", "--cp-size", "2"]


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def hinted_budget(message: str) -> int:
    return int(re.search(r"to at least (\d+)", message).group(1))


@pytest.mark.parametrize(
    "name,ranks,lengths",
    [  # the whole domain (4 ranks × 8 = 32 tokens), static CP2 (16 tokens); the longest: 2
        ("default_dynamic_cp", 4, [5, 40, 101, 3, 70]),
        ("dp_balanced", 2, [5, 20, 31, 3, 25]),
    ],
)
def test_budget_hint_is_the_longest_sample_rounded_to_a_training_budget(name, ranks, lengths):
    scheduler = build_scheduler(name, dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8)
    with pytest.raises(SchedulingError) as info:
        scheduler.schedule(lengths)  # lengths[1] is the first that does not fit
    message = str(info.value)
    assert f"sample 2 has {lengths[2]} tokens" in message
    least = hinted_budget(message)
    assert least == least_budget(lengths[2], ranks) and least % budget_multiple() == 0
    assert least * ranks >= lengths[2] and (least - budget_multiple()) * ranks < lengths[2]
    fitting = build_scheduler(name, dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=least)
    fitting.schedule(lengths)  # the hinted budget holds every sample


def test_budget_hint_counts_the_samples_that_do_not_fit():
    with pytest.raises(SchedulingError, match="longest of 3 that do not fit"):
        Domain(1, 2, 8).check_seqlens([17, 1, 30, 20])
    with pytest.raises(SchedulingError) as info:
        Domain(1, 2, 8).check_seqlens([17, 1])
    assert "do not fit" not in str(info.value) and "at least 10" in str(info.value)


@pytest.mark.parametrize(
    "tokens,ranks,multiple,least", [(33, 4, 2, 10), (32, 4, 2, 8), (1, 8, 2, 2), (100, 2, 8, 56)]
)
def test_least_budget(tokens, ranks, multiple, least):
    assert least_budget(tokens, ranks, multiple) == least
    assert budget_multiple(4, sequence_parallel=True) == 8 and budget_multiple(4) == 2


def test_simulate_hint_holds_when_the_batch_grows_with_the_budget(capsys):
    code, _, err = run(capsys, [*ISSUE_SIMULATE, "--max-seqlen-per-dp-cp-rank", "1024"])
    least = hinted_budget(err)
    assert code == 2 and err.count("error:") == 1 and least % 2 == 0
    argv = [*ISSUE_SIMULATE, "--max-seqlen-per-dp-cp-rank", str(least), "--no-peer"]
    code, out, _ = run(capsys, argv)
    assert code == 0 and "n/a" not in out
    code, _, err = run(capsys, [*ISSUE_SIMULATE, "--max-seqlen-per-dp-cp-rank", str(least - 2)])
    assert code == 2 and hinted_budget(err) == least  # the least such budget


def test_simulate_hint_with_a_fixed_batch_is_the_longest_sample(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("3000\n100\n5000\n")
    argv = ["simulate", "--lengths", str(path), "--dp-size", "1", "--cp-size", "2"]
    code, _, err = run(capsys, [*argv, "--max-seqlen-per-dp-cp-rank", "512"])
    assert code == 2 and "sample 2 has 5000 tokens" in err and hinted_budget(err) == 2500
    assert "larger batch" not in err


# Short runs, should the refusal be missing.
QUICK = {
    "simulate": ["--no-peer", "--num-sequences", "4"],
    "benchmark": ["--no-timing", "--workload", "uniform", "--vpp", "1", "--cost-model", "model"],
}


@pytest.mark.parametrize(
    "command,flag", [("simulate", "--max-seqlen-per-dp-cp-rank"), ("benchmark", "--budget")]
)
def test_a_budget_training_refuses_is_refused(capsys, command, flag):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, *QUICK[command], flag, "1385"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"argument {flag}: 1385 is not a multiple of 2" in err and "use 1384 or 1386" in err


@pytest.mark.parametrize(
    "size,words",
    [(1, "1"), (2, "1 or 2"), (4, "1, 2 or 4"), (8, "1, 2, 4 or 8"), (64, "1, 2, 4, ... up to 64")],
)
def test_size_wording_lists_only_the_sizes_there_are(size, words):
    assert size_choices(size) == words


def test_min_cp_size_error_on_a_domain_of_two():
    with pytest.raises(SchedulingError, match=r"use 1 or 2\.$"):
        Domain(1, 2, 8, min_cp_size=4)


def test_shortened_notes():
    assert compare.shortened("short") == "short"
    long = "word " * 60
    cut = compare.shortened(long, 50)
    assert len(cut) <= 50 and cut.endswith(" …") and "wor …" not in cut
    assert compare.without_prefix("peer: bad input", "peer") == "bad input"


def test_benchmark_gives_the_reason_for_every_na_cell(capsys):
    argv = ["benchmark", "--workload", "uniform", "--no-timing", "--cost-model", "model"]
    code, out, _ = run(capsys, [*argv, "--budget", "2048", "--vpp", "1", "--vpp", "2"])
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("uniform b2048")]
    na_rows = [row.split()[2] for row in rows if " n/a " in row]
    assert na_rows == ["vpp2"]
    notes = [line for line in out.splitlines() if line.startswith("n/a")]
    assert notes == [
        "n/a   dev in uniform b2048 vpp2: cannot reach a multiple of 2 micro-batches: no "
        "micro-batch has more than one CP group to split (upstream asserts)"
    ]


def test_na_reasons_share_a_line_per_column_and_reason():
    failed = compare.SchedulerResult("x", note="too long")
    omitted = compare.SchedulerResult("y", note="omitted: no megatron", omitted=True)
    lines = compare.na_reasons(
        [("case 1", [("ours", failed), ("peer", omitted)]), ("case 2", [("ours", failed)])]
    )
    assert lines == [
        "n/a   ours in case 1, case 2: too long",
        "note  peer in case 1: omitted: no megatron",
    ]
