"""The offline replay of a ``bench-train`` run's refinement (``tools.refinement.replay``): a run
folder written the way ``bench-train`` writes it (plans from :class:`ArmRotation`, per-position
times), replayed; predictions lag the refinement by two steps as in training; a noise-free run is
learned; under drifting, spiking load (another process on the cores) the refinement holds its
median error where the one it replaced left its factors at their bounds; the command's table."""

import json
import random
from pathlib import Path

import pytest

from megatron_dcp.scheduling import CostModel
from megatron_dcp.scheduling.cost_fit import (
    CostProfile,
    OnlineRefinement,
    coefficients,
    microbatch_features,
    microbatch_points,
    predict,
    rank_features,
    save_profile,
)
from megatron_dcp.tools.bench_train.arms import ArmRotation, as_record
from megatron_dcp.tools.cli.main import main
from megatron_dcp.tools.refinement.replay import (
    VARIANTS,
    bound_steps,
    flag_values,
    load_run,
    parse_variants,
    replay,
    replay_errors,
)

PRIOR = CostModel(5.8e-5, 9.4e-8, 2.8e-5, 0.016, 1.0, "model@cpu-gloo", 0.016)
# The machine: every coefficient off the prior (the shape too, not only the level).
TRUE = [f * t for f, t in zip((1.4, 1.2, 1.5, 2.0, 0.8, 1.3, 1.0), coefficients(PRIOR))]
ARMS = ("static", "dcp", "megatron_dev")


def batch(rng: random.Random) -> list:
    """A long-sequence-heavy batch: 60 % lognormal around 600, 40 % uniform in [2048, 4096]."""
    lengths = []
    for _ in range(8):
        if rng.random() < 0.6:
            lengths.append(max(64, min(4096, int(rng.lognormvariate(6.4, 0.8)))))
        else:
            lengths.append(rng.randint(2048, 4096))
    return lengths


def write_run(
    out: Path, load, iterations: int = 30, seed: int = 0, per_microbatch: bool = False
) -> Path:
    """A run folder: plans of every arm under the prior, times from ``TRUE`` × ``load(t)``;
    ``per_microbatch``: also per position and micro-batch, as ``bench-train`` now records them
    (else the totals only, as runs recorded before)."""
    rng = random.Random(seed)
    records = []
    rotation = ArmRotation(
        ARMS,
        record=lambda b, figures: records.append(as_record(b, figures)),
        dp_size=1,
        cp_size=2,
        max_seqlen_per_dp_cp_rank=2048,
        cost_model=PRIOR,
    )
    times = []
    for t in range(1, iterations + 1):
        plan = rotation.schedule(batch(rng))
        factor = load(t, rng)
        record = {"call": t, "times": [predict(TRUE, r) * factor for r in rank_features(plan)]}
        if per_microbatch:
            positions = microbatch_features(plan)
            record["microbatch_times"] = [[predict(TRUE, r) * factor for r in p] for p in positions]
            record["unclaimed"] = [0.0] * len(positions)
        times.append(record)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plans.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "times.jsonl").write_text("".join(json.dumps(t) + "\n" for t in times))
    (out / "bench_train.json").write_text(json.dumps({"arms": list(ARMS), "flags": []}))
    save_profile(str(out / "prior.json"), CostProfile(PRIOR, {"by": "test"}))
    return out


def steady(t, rng):
    return 1.0


def contended(t, rng):
    """Another process on the cores: a load that drifts from 1 to 1.8 over the run, ±10 %
    jitter, and one step in six slowed by 40-120 %."""
    spike = 1.0 + rng.uniform(0.4, 1.2) if rng.random() < 1 / 6 else 1.0
    return (1.0 + 0.8 * t / 30) * rng.uniform(0.9, 1.1) * spike


def test_the_replay_predicts_each_step_with_the_model_of_two_steps_before(tmp_path):
    run = load_run(write_run(tmp_path, contended))
    assert run.prior == PRIOR and [s.arm for s in run.steps[:4]] == list(ARMS) + ["dcp"]
    steps = replay(run, VARIANTS["current"])
    reference, thetas = OnlineRefinement(PRIOR), [coefficients(PRIOR)]
    for k, step in enumerate(run.steps):
        theta = thetas[max(0, k - 1)]
        assert steps[k].predicted_s == max(predict(theta, row) for row in step.features)
        reference.update(step.features, step.times)
        thetas.append(coefficients(reference.cost))


def test_a_run_timed_per_micro_batch_is_replayed_from_those_points(tmp_path):
    """The refinement is fed what training fed it: one point per position and micro-batch
    (the plan's per-micro-batch features from plans.jsonl), the step predicted from the totals."""
    run = load_run(write_run(tmp_path, contended, iterations=6, per_microbatch=True))
    reference, thetas = OnlineRefinement(PRIOR), [coefficients(PRIOR)]
    for k, (step, replayed) in enumerate(zip(run.steps, replay(run))):
        rows, times = step.points()
        assert len(rows) == len(times) > len(step.features)  # several micro-batches
        assert (rows, times) == microbatch_points(step.microbatch_features, step.microbatch_times)
        assert replayed.predicted_s == max(predict(thetas[max(0, k - 1)], r) for r in step.features)
        reference.update(rows, times)
        thetas.append(coefficients(reference.cost))
    assert replayed.factors == reference.factors


def test_a_noise_free_run_is_learned(tmp_path):
    steps = replay(load_run(write_run(tmp_path, steady)))
    assert max(s.error for s in steps[9:]) < 0.03


def test_under_contention_the_refinement_holds_where_the_old_one_hit_its_bounds(tmp_path):
    for seed in range(3):
        run = load_run(write_run(tmp_path / str(seed), contended, seed=seed))
        current, before = replay(run, VARIANTS["current"]), replay(run, VARIANTS["before"])
        assert replay_errors(current)["5-30"] <= 0.2 and bound_steps(current) == 0
        assert bound_steps(before) > 0


def test_flags_and_variants_are_read():
    flags = ["--num-layers", "2", "--lr", "1e-4", "--swiglu", "--varlen-distribution", "a:b"]
    assert flag_values(flags) == {
        "--num-layers": 2,
        "--lr": 1e-4,
        "--swiglu": True,
        "--varlen-distribution": "a:b",
    }
    assert [v.name for v in parse_variants("current, before")] == ["current", "before"]
    with pytest.raises(ValueError, match="--variants=nope: choose from current"):
        parse_variants("nope")


def test_the_command_prints_steps_or_a_summary(tmp_path, capsys):
    one = write_run(tmp_path / "one", contended)
    assert main(["replay-refinement", str(one)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == 32 and "median |pred - meas| / meas (current): 5-30" in printed
    assert main(["replay-refinement", str(one), "--variants", "current,before"]) == 0
    assert "worst run" in capsys.readouterr().out
    assert main(["replay-refinement", str(tmp_path / "none")]) == 2
    assert "no times.jsonl" in capsys.readouterr().err
