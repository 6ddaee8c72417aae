"""``megatron-dcp bench-train`` end to end on 2 CPU ranks: a fair run reports every arm from
real training steps; a run whose one arm reads perturbed samples is refused by the digest check
(the fault injected through the worker's test-only ``MEGATRON_DCP_BENCH_PERTURB``; that run has
the cost model's refinement off, and its steps are timed all the same). The fair
run (its first compared batch profiled: ``--profile 1``) trained the model its flags ask for (megatron's parameter count in its log against
``testing.model_size``), and its refinement replayed offline predicts its ``[DCP]`` lines."""

import json

import pytest

from megatron_dcp.scheduling.cost_fit import coefficients
from megatron_dcp.testing.model_size import check_model_size, flags_of
from megatron_dcp.tools.bench_train.run import DigestMismatch
from megatron_dcp.tools.bench_train.run_flags import training_flags
from megatron_dcp.tools.cli.bench_train import bench_train
from megatron_dcp.tools.launching.training_runs import parse_log
from megatron_dcp.tools.refinement.replay import load_run, replay, run_prior

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "1024", "--max-position-embeddings", "1024",
    "--global-batch-size", "8", "--max-seqlen-per-dp-cp-rank", "512",
    "--varlen-distribution", "lognormal:median=200,sigma=0.8,min=16,max=1024",
]  # fmt: skip
BENCH = ["--nproc", "2", "--arms", "static,dcp", "--batches", "3", "--warmup", "1"]


def test_a_fair_run_reports_every_arm_from_real_steps(tmp_path, capsys):
    assert bench_train([*BENCH, "--out", str(tmp_path), "--profile", "1", *TINY]) == 0
    printed = capsys.readouterr().out
    assert "one rank per core" in printed and "speedup vs static" in printed
    check_attribution(printed, tmp_path)
    result = json.loads((tmp_path / "bench_train.json").read_text())
    turns = ["static", "dcp", "dcp", "static", "static", "dcp"]  # rotated every batch
    assert [s["arm"] for s in result["steps"]] == turns
    assert all(s["step_ms"] > 0 and s["fwd_bwd_ms"] > 0 for s in result["steps"])
    dcp = result["summaries"]["dcp"]
    assert dcp["speedup"]["low"] <= dcp["speedup"]["value"] <= dcp["speedup"]["high"]
    assert (tmp_path / "bench_train.png").stat().st_size > 0
    flags = flags_of(training_flags(TINY, 2, len(turns)))
    check_model_size(flags, parse_log((tmp_path / "train.log").read_text()).parameters)
    check_replay(tmp_path, result["flags"])


def check_attribution(printed, out):
    """--profile 1: the first compared batch of each arm profiled, its table printed and kept,
    every region of the model and of the batch's preparation found, each arm's busiest rank
    holding the sequences and micro-batches its plan gave it."""
    table = (out / "profile" / "attribution.md").read_text()
    assert table.splitlines()[2] in printed
    for region in ("core attention", "RoPE", "MLP", "QKV/out projections", "loss", "read samples",
                   "plan", "K/V exchange", "autograd engine"):  # fmt: skip
        assert f"| {region} |" in table, region
    assert sorted(p.name for p in (out / "profile").glob("*_rank*.json")) == [
        "dcp_b1_rank0.json", "dcp_b1_rank1.json", "static_b1_rank0.json", "static_b1_rank1.json",
        "trace_dcp_b1_rank0.json", "trace_static_b1_rank0.json",
    ]  # fmt: skip
    plans = [json.loads(line) for line in (out / "plans.jsonl").read_text().splitlines()]
    static = plans[1]["arms"]["static"]
    held = [row for row in table.splitlines() if row.startswith("| *sequences held*")][0]
    assert held.split("|")[4].strip() == f"{len(static['sequences'][0]):.1f}"  # every sequence


def check_replay(out, flags):
    """The offline replay predicts every step as the run's ``[DCP]`` line did (printed to
    0.1 ms), from the run's prior.json and from the prior its flags give."""
    run = load_run(out)
    for step in replay(run):
        assert step.predicted_s * 1e3 == pytest.approx(step.logged_s * 1e3, abs=0.06)
    rebuilt = run_prior(out, flags, "cpu-gloo", recorded=False)
    assert coefficients(rebuilt) == pytest.approx(coefficients(run.prior), rel=1e-12)


def test_an_arm_that_reads_other_samples_is_refused(tmp_path, monkeypatch):
    """Run with --dcp-cost-adapt off: the benchmark still times every step (its own request)."""
    monkeypatch.setenv("MEGATRON_DCP_BENCH_PERTURB", "dcp")
    with pytest.raises(DigestMismatch, match="global batch 0: the arms read different samples"):
        bench_train([*BENCH, "--out", str(tmp_path), *TINY, "--dcp-cost-adapt", "off"])
    figures = parse_log((tmp_path / "train.log").read_text()).dcp
    records = (tmp_path / "times.jsonl").read_text().splitlines()
    assert len(figures) == len(records) == 6
    assert all(f.measured_step_ms > 0 and f.tokens_per_s > 0 for f in figures.values())
    assert "cost x prior" not in (tmp_path / "train.log").read_text()  # not refining
