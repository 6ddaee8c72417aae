"""``megatron-dcp calibrate``: the grid and its seeded hold-out split, the aggregation of per-rank
timings, bad flags rejected before anything starts, and a real (tiny) calibration on 2 gloo ranks
whose profile ``load_profile`` reads back."""

import argparse
from collections import Counter

import pytest

from megatron_dcp.scheduling.cost_fit import FEATURES, load_profile
from megatron_dcp.tools.calibration.fit import (
    available_cores,
    check_split,
    cp_sizes,
    grid,
    split_hold_out,
)
from megatron_dcp.tools.calibration.rank_timing import Point, point_times
from megatron_dcp.tools.cli import main as cli

TINY_MODEL = [
    "--num-layers", "1",
    "--hidden-size", "64",
    "--num-attention-heads", "2",
    "--ffn-hidden-size", "128",
    "--seq-length", "512",
    "--max-position-embeddings", "512",
    "--vocab-size", "2048",
    "--position-embedding-type", "rope",
]  # fmt: skip


def options(**overrides):
    values = dict(nproc=2, lengths=None, pack_sizes=(1, 2, 4), max_tokens=None)
    return argparse.Namespace(**{**values, **overrides})


def test_default_grid_is_capped_by_seq_length_and_max_tokens():
    points = grid(options(), seq_length=1024)
    assert {p.cp_size for p in points} == {1, 2}
    assert {p.lengths[0] for p in points} == {128, 256, 512, 1024}
    assert all(sum(p.lengths) <= 1024 for p in points)
    assert Counter(len(p.lengths) for p in points if p.cp_size == 1) == {1: 4, 2: 3, 4: 2}
    assert len(grid(options(max_tokens=512), seq_length=1024)) == 2 * (3 + 2 + 1)


def test_cp_sizes_are_the_powers_of_two_up_to_nproc():
    assert [cp_sizes(n) for n in (1, 2, 3, 4, 6)] == [(1,), (1, 2), (1, 2), (1, 2, 4), (1, 2, 4)]


def test_hold_out_is_seeded_and_per_cp_size():
    points = grid(options(), seq_length=4096)
    held = split_hold_out(points, 0.25, seed=1234)
    assert held == split_hold_out(points, 0.25, seed=1234)
    assert held != split_hold_out(points, 0.25, seed=7)
    for cp in (1, 2):
        mine = [h for p, h in zip(points, held) if p.cp_size == cp]
        assert sum(mine) == max(1, round(0.25 * len(mine)))
    check_split(held, 0.25)


def test_a_split_too_small_to_fit_is_refused():
    points = grid(options(lengths=(128, 256), pack_sizes=(1,)), seq_length=1024)
    with pytest.raises(ValueError, match=r"--hold-out=0\.25 leaves 2 fit and 2 held-out"):
        check_split(split_hold_out(points, 0.25, seed=0), 0.25)


def test_a_point_takes_its_slowest_member_and_its_fastest_pass():
    points = [Point((64,), 1), Point((64, 64), 2)]
    per_rank = [  # [point][timing] seconds on ranks 0 and 1
        [[0.5, 0.4, 0.6], [2.0, 3.0]],
        [[0.3, 0.9, 0.8], [2.5, 1.0]],
    ]
    assert point_times(per_rank, points) == [0.3, 2.5]
    # the last feature, vision, is 0: calibration points run no encoder
    assert Point((64, 64), 2).features() == [64.0, 0.0, 4096.0, 64.0, 1.0, 1.0, 0.0, 2.0, 0.0]


def test_nproc_beyond_the_cores_is_refused(capsys, tmp_path):
    cores = available_cores()
    code = cli.main(["calibrate", "--output", str(tmp_path / "p.json"), "--nproc", str(cores + 1)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--nproc={cores + 1}" in err and f"{cores} cores" in err


def test_an_output_folder_that_does_not_exist_is_refused(capsys, tmp_path):
    output = tmp_path / "missing" / "p.json"
    assert cli.main(["calibrate", "--output", str(output), *TINY_MODEL]) == 2
    assert f"--output={output}: cannot write into" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        ([], "the following arguments are required: --output"),
        (["--output", "p.json", "--hold-out", "1.5"], "argument --hold-out: 1.5 must lie"),
        (["--output", "p.json", "--pack-sizes", "1,0"], "argument --pack-sizes: 0 must be"),
    ],
)
def test_bad_calibration_flags_are_argparse_errors(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["calibrate", *flags, *TINY_MODEL])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_lengths_beyond_seq_length_are_refused_before_measuring(capsys, tmp_path):
    output = tmp_path / "p.json"
    code = cli.main(["calibrate", "--output", str(output), "--lengths", "256,1024", *TINY_MODEL])
    captured = capsys.readouterr()
    assert code == 2 and "--lengths=256,1024" in captured.err and "--seq-length=512" in captured.err
    assert "points on CP sizes" not in captured.out and not output.exists()


@pytest.mark.skipif(available_cores() < 2, reason="2 ranks need 2 cores")
def test_tiny_calibration_writes_a_profile(capfd, tmp_path):
    """... and reports its timed passes from rank 0 (a forked rank: captured at the fd)."""
    output = tmp_path / "profile.json"
    grid_flags = ["--lengths", "64,128,256,512", "--pack-sizes", "1,2", "--repeats", "2"]
    argv = ["calibrate", "--output", str(output), "--nproc", "2", *grid_flags, "--timeout", "120"]
    assert cli.main([*argv, *TINY_MODEL]) == 0
    out = capfd.readouterr().out
    passes = [line for line in out.splitlines() if line.startswith("calibrate: ")]
    assert passes[1].startswith("calibrate: 1/2 timed passes of 14 points, ")
    assert passes[2].startswith("calibrate: 2/2 timed passes of 14 points, ")
    profile = load_profile(str(output))
    source = profile.source
    # Some work per token: on 14 timed points of a tiny model on shared cores the least-squares
    # fit may carry it in the quadratic term alone (seen in 2 of about 10 runs on 2026-11-29).
    assert profile.cost.linear > 0 or profile.cost.quadratic > 0
    assert source["ranks"] == 2 and source["threads_per_rank"] == 1 and source["backend"] == "gloo"
    assert "--hidden-size" in source["model_flags"] and source["grid"]["cp_sizes"] == [1, 2]
    held = [p for p in source["points"] if p["held_out"]]
    assert len(held) == source["held_out_points"] >= 2
    assert source["fit_points"] + len(held) == len(source["points"]) == 2 * 7
    assert source["fit_points"] >= len(FEATURES)
    assert 0 <= source["held_out_median_error"] <= source["held_out_max_error"]
    assert source["train_median_error"] >= 0
    assert all(p["measured_s"] > 0 and p["predicted_s"] > 0 for p in source["points"])
    assert "measured ms" in out and "held-out relative error: median" in out
    assert len([line for line in out.splitlines() if "%" in line]) >= len(held)


def test_the_model_flags_parse_in_a_fresh_interpreter(tmp_path):
    """As the console script runs it: megatron not imported yet (the CPU backend must come
    first, or megatron.training fails to import without triton)."""
    import subprocess
    import sys

    code = (
        "from megatron_dcp.tools.cli.calibrate import parse_model_args; "
        f"print(parse_model_args({[*TINY_MODEL, '--output', str(tmp_path / 'p.json')]!r})"
        ".hidden_size)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == TINY_MODEL[TINY_MODEL.index("--hidden-size") + 1]
