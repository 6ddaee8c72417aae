"""bench-train's pure parts: the arms' turns, paired intervals on synthetic step times with a
known speedup, the model-ordering score, the digest check, the refusal of oversubscription and
the flags it passes to training."""

import random

import pytest

from megatron_dcp.tools.bench_train import run_flags
from megatron_dcp.tools.bench_train.arms import arm_at, parse_arms
from megatron_dcp.tools.bench_train.run import DigestMismatch, check_cores, check_digests
from megatron_dcp.tools.bench_train.run_flags import training_flags
from megatron_dcp.tools.bench_train.stats import median_interval, ordering, speedup_interval
from megatron_dcp.tools.launching import training_runs

ARMS = ("static", "dcp", "megatron_dev")


def test_every_batch_runs_every_arm_once_and_each_arm_takes_every_turn():
    turns = {arm: set() for arm in ARMS}
    for batch in range(len(ARMS)):
        runs = [arm_at(batch * len(ARMS) + turn + 1, ARMS) for turn in range(len(ARMS))]
        assert {b for b, _ in runs} == {batch}
        assert sorted(arm for _, arm in runs) == sorted(ARMS)
        for turn, (_, arm) in enumerate(runs):
            turns[arm].add(turn)
    assert all(t == set(range(len(ARMS))) for t in turns.values())


def synthetic(speedup: float, batches: int = 40, seed: int = 0):
    """Step times that vary 4-fold between batches, the arm ``speedup`` × faster, ±3 % noise."""
    rng = random.Random(seed)
    base = [rng.uniform(500.0, 2000.0) for _ in range(batches)]
    static = [t * rng.uniform(0.97, 1.03) for t in base]
    other = [t / speedup * rng.uniform(0.97, 1.03) for t in base]
    return static, other


@pytest.mark.parametrize("speedup", [0.9, 1.0, 1.05, 1.25])
def test_the_speedup_interval_holds_the_known_speedup_and_is_narrow(speedup):
    interval = speedup_interval(*synthetic(speedup))
    assert interval.contains(speedup)
    assert interval.high - interval.low < 0.04  # pairing removes the 4-fold batch spread
    assert interval.contains(1.0) == (speedup == 1.0)


def test_pooled_times_would_hide_what_pairing_shows():
    """Unpaired, the batch spread swamps a 5 % speedup; the paired interval excludes 1."""
    static, other = synthetic(1.05)
    assert speedup_interval(static, other).low > 1.0
    assert median_interval(static).contains(median_interval(other).value)


def test_median_interval_contains_the_median_and_rejects_no_times():
    times = [float(t) for t in range(1, 102)]
    interval = median_interval(times)
    assert interval.value == 51.0 and interval.low < 51.0 < interval.high
    with pytest.raises(ValueError, match="no step times"):
        median_interval([])


def test_ordering_counts_clear_and_close_pairs():
    pairs = [
        (1.0, 1.2, 10.0, 12.0),  # clear, agrees
        (1.0, 1.2, 12.0, 10.0),  # clear, disagrees
        (1.0, 1.05, 10.0, 11.0),  # close, agrees
    ]
    result = ordering(pairs)
    assert (result.clear_agree, result.clear_total) == (1, 2)
    assert (result.close_agree, result.close_total) == (1, 1)


def write_digests(tmp_path, arms, batches, perturb=None):
    folder = tmp_path / "digests"
    folder.mkdir()
    for rank in range(2):
        lines = []
        for iteration in range(1, batches * len(arms) + 1):
            batch, arm = arm_at(iteration, arms)
            digest = f"batch{batch}rank{rank}" + ("x" if arm == perturb else "")
            lines.append(f"{iteration - 1} {digest}")
        (folder / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")


def test_digest_check_passes_when_every_arm_read_the_same_samples(tmp_path):
    write_digests(tmp_path, ARMS, batches=4)
    check_digests(tmp_path, ARMS, 4)


def test_digest_check_fails_when_one_arm_read_other_samples(tmp_path):
    write_digests(tmp_path, ARMS, batches=4, perturb="dcp")
    with pytest.raises(DigestMismatch, match="global batch 0: the arms read different samples"):
        check_digests(tmp_path, ARMS, 4)


def test_digest_check_fails_without_digests(tmp_path):
    with pytest.raises(DigestMismatch, match="no sample digests"):
        check_digests(tmp_path, ARMS, 4)


def test_more_ranks_than_cores_is_refused_unless_accepted(monkeypatch):
    monkeypatch.setattr(training_runs, "available_cores", lambda: 2)
    check_cores(2, oversubscribe=False)
    with pytest.raises(ValueError, match="--nproc=4: .* 2 cores.*--oversubscribe"):
        check_cores(4, oversubscribe=False)
    check_cores(4, oversubscribe=True)


def test_arms_need_static_and_known_names():
    assert parse_arms("static,dcp") == ("static", "dcp")
    for text in ("dcp,megatron_dev", "static", "static,static", "static,fastest"):
        with pytest.raises(ValueError, match="--arms="):
            parse_arms(text)


def test_training_flags_take_the_users_over_the_defaults_and_refuse_forced_ones():
    flags = training_flags(["--num-layers", "2", "--sft-data", "c.jsonl"], nproc=2, iterations=9)
    assert flags.count("--num-layers") == 1 and flags[flags.index("--num-layers") + 1] == "2"
    assert "--varlen-distribution" not in flags  # the SFT data replaces the mock lengths
    assert flags[flags.index("--context-parallel-size") + 1] == "2"
    assert flags[flags.index("--train-iters") + 1] == "9"
    with pytest.raises(ValueError, match="--train-iters: bench-train sets"):
        training_flags(["--train-iters", "5"], nproc=2, iterations=9)
    with pytest.raises(ValueError, match="--train-iters: bench-train sets"):
        training_flags(["--train-iters=5"], nproc=2, iterations=9)  # the = form alike


@pytest.mark.parametrize("source", ["--sft-data", "--varlen-lengths-file", "--data-path"])
def test_the_users_data_replaces_the_mock_lengths(source):
    for given in ([source, "x"], [f"{source}=x"]):
        flags = training_flags(given, nproc=2, iterations=3)
        assert "--varlen-distribution" not in flags, given


def test_on_cpu_the_preparation_runs_between_the_steps_unless_the_user_says_otherwise(monkeypatch):
    """Where the ranks compute on the CPU, no background work: no prefetch thread, no data-loader
    worker processes (each would take its time from the step it overlaps); the user's flags
    win. On a GPU, training's defaults."""
    monkeypatch.setattr(run_flags, "cuda_ranks", lambda: False)
    flags = training_flags([], nproc=2, iterations=3)
    assert flags[flags.index("--dcp-prefetch") + 1] == "off"
    assert flags[flags.index("--num-workers") + 1] == "0"
    flags = training_flags(["--dcp-prefetch", "on", "--num-workers", "2"], nproc=2, iterations=3)
    assert flags.count("--dcp-prefetch") == flags.count("--num-workers") == 1
    assert flags[flags.index("--dcp-prefetch") + 1] == "on"
    monkeypatch.setattr(run_flags, "cuda_ranks", lambda: True)
    assert "--dcp-prefetch" not in training_flags([], nproc=2, iterations=3)
