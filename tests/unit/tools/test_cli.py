"""The ``megatron-dcp`` CLI (simulate, benchmark, fuzz) and the plot (the megatron-core peer:
tests/integration/test_megatron_peer.py)."""

import argparse
import json
import sys
import types

import pytest

from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.tools import benchmark_matrix as benchmark
from megatron_dcp.tools import compare
from megatron_dcp.tools.cli import benchmark as benchmark_command
from megatron_dcp.tools.cli import main as cli
from megatron_dcp.tools.peers import megatron_hybrid_cp as peer

SMALL = [
    "simulate",
    "--dp-size",
    "2",
    "--cp-size",
    "2",
    "--max-seqlen-per-dp-cp-rank",
    "512",
    "--distribution",
    "uniform:min=1,max=1000",
    "--num-sequences",
    "24",
]


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_table(capsys):
    code, out, _ = run(capsys, [*SMALL, "--no-peer"])
    assert code == 0
    for text in ("default_dynamic_cp", "dp_balanced", "critical path", "CP/LB", "plan ms"):
        assert text in out
    assert peer.PEER_NAME not in out


def test_simulate_json(capsys):
    code, out, _ = run(capsys, [*SMALL, "--no-peer", "--json", "--cost-model", "attention"])
    data = json.loads(out)
    assert code == 0 and data["cost_model"] == "attention" and data["num_sequences"] == 24
    for result in data["results"]:
        assert result["ratio"] >= 1 - 1e-9 and result["num_microbatches"] >= 1
        assert result["max_tokens_per_rank"] <= 512


def test_simulate_lengths_file_and_na_row(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("# two sequences\n2000\n100\n")
    argv = [
        "simulate",
        "--lengths",
        str(path),
        "--dp-size",
        "2",
        "--cp-size",
        "2",
        "--max-seqlen-per-dp-cp-rank",
        "512",
        "--no-peer",
    ]
    code, out, _ = run(capsys, argv)
    assert code == 0
    assert "n/a   dp_balanced: --max-seqlen-per-dp-cp-rank=512" in out
    assert "default_dynamic_cp" in out.split("n/a")[0]


def test_simulate_fails_when_no_scheduler_can_plan(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("100\n")
    argv = ["simulate", "--lengths", str(path), "--dp-size", "1", "--cp-size", "2"]
    argv += ["--max-seqlen-per-dp-cp-rank", "512", "--microbatch-group-size-per-vp-stage", "2"]
    code, out, _ = run(capsys, [*argv, "--no-peer"])
    assert code == 2 and out.count("n/a") == 3


@pytest.mark.parametrize("flag", ["--num-sequences", "--tokens-per-global-batch"])
def test_a_lengths_file_refuses_a_batch_size_it_would_ignore(tmp_path, capsys, flag):
    path = tmp_path / "lengths.txt"
    path.write_text("100\n200\n")
    code, _, err = run(capsys, ["simulate", "--lengths", str(path), flag, "5", "--no-peer"])
    assert code == 2 and f"{flag}=5: the lengths file" in err and "leave" in err


def test_bad_distribution_names_the_flag(capsys):
    code, _, err = run(capsys, ["simulate", "--distribution", "normal:mean=3", "--no-peer"])
    assert code == 2 and "--distribution='normal:mean=3'" in err


@pytest.mark.parametrize("flag,value", [("--dp-size", "0"), ("--min-cp-size", "3")])
def test_bad_layout_flags_are_argparse_errors(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["simulate", flag, value])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_benchmark_restricted(monkeypatch, capsys):
    monkeypatch.setattr(benchmark, "TIMING_LAYOUTS", ((2, 2, 40), (4, 2, 80)))
    argv = ["benchmark", "--workload", "uniform", "--cost-model", "attention", "--quick"]
    argv += ["--budget", "4096", "--vpp", "1", "--vpp", "2"]
    code, out, _ = run(capsys, argv)
    assert code == 0
    assert "uniform b4096 vpp1" in out and "uniform b4096 vpp2" in out and "b2048" not in out
    assert "ours/dev: mean" in out and "ours ≤ 1.05 × LB in" in out
    assert "== plan time" in out and "dp 2 × cp 2" in out and "dp 4 × cp 2" not in out
    header = out.split("== plan time")[1].splitlines()[3]
    assert header.split("scheduler")[1].split() == ["plan", "ms", "CP/LB", "mb", "peak", "MiB"]
    row = next(line for line in out.splitlines() if "dp 2 × cp 2" in line and "default_dyn" in line)
    ratio, microbatches, peak = row.split()[-3:]
    assert float(ratio) >= 1 - 1e-9 and int(microbatches) >= 1 and float(peak) >= 0


def small_timing_layouts(monkeypatch):
    """Four tiny plan-time layouts (N = 4, 8, 16, 32); the peer only at N = 4, one run from 16."""
    layouts = ((2, 2, 40), (4, 2, 80), (8, 2, 160), (16, 2, 320))
    monkeypatch.setattr(benchmark, "TIMING_LAYOUTS", layouts)
    monkeypatch.setattr(benchmark, "PEER_MAX_TIMING_N", 4)
    monkeypatch.setattr(benchmark, "SINGLE_RUN_N", 16)
    monkeypatch.setattr(benchmark_command, "benchmark_comparisons", lambda args: [])


def test_benchmark_timing_rows_and_max_timing_n(monkeypatch, capsys):
    small_timing_layouts(monkeypatch)
    code, out, _ = run(capsys, ["benchmark", "--max-timing-n", "16"])
    assert code == 0 and "(1 run at N = 16)" in out and "dp 16 × cp 2" not in out
    rows = [line.split() for line in out.splitlines() if "× cp 2" in line]
    assert [(r[0], r[8]) for r in rows] == [
        ("4", "default_dynamic_cp"),
        ("4", "dp_balanced"),
        ("4", "megatron-0.19.2"),
        ("8", "default_dynamic_cp"),
        ("8", "dp_balanced"),
        ("16", "default_dynamic_cp"),
        ("16", "dp_balanced"),
    ]
    assert "note: megatron-0.19.2 BalancedCPScheduler is timed up to N = 4 only" in out
    code, out, _ = run(capsys, ["benchmark", "--max-timing-n", "4"])
    assert code == 0 and "dp 4 × cp 2" not in out and "note:" not in out and "1 run" not in out


def test_benchmark_timing_json(monkeypatch, capsys):
    small_timing_layouts(monkeypatch)
    code, out, _ = run(capsys, ["benchmark", "--max-timing-n", "16", "--json"])
    rows = json.loads(out)["plan_time"]
    assert code == 0 and [r["domain_size"] for r in rows] == [4, 4, 4, 8, 8, 16, 16]
    assert [r["repeats"] for r in rows] == [3] * 5 + [1] * 2
    for r in rows:
        assert r["median_ms"] > 0 and r["ratio"] >= 1 - 1e-9 and r["num_microbatches"] >= 1
        assert r["peak_mib"] > 0


def test_peak_memory_is_the_schedule_calls():
    from megatron_dcp.tools import plan_memory

    spec = compare.DomainSpec(2, 2, 512)
    cost = build_cost_model("model")
    small = plan_memory.schedule_peak_mib("default_dynamic_cp", [300] * 8, spec, cost)
    large = plan_memory.schedule_peak_mib("default_dynamic_cp", [300] * 800, spec, cost)
    assert 0 < small < large
    assert plan_memory.schedule_peak_mib("dp_balanced", [5000], spec, cost) is None
    assert plan_memory.traced_peak_bytes(lambda: bytearray(4 << 20)) >= 4 << 20


def test_ranks_per_node_counts_the_groups_that_cross_nodes(capsys):
    argv = ["simulate", "--workload", "uniform", "--no-peer", "--ranks-per-node", "8", "--json"]
    code, out, _ = run(capsys, argv + ["--max-seqlen-per-dp-cp-rank", "2048"])
    results = json.loads(out)["results"]
    planned = [r for r in results if "error" not in r]  # static CP4 cannot hold 32K
    assert code == 0 and planned and all(r["crossing_groups"] > 0 for r in planned)
    argv = ["benchmark", "--workload", "uniform", "--no-timing", "--cost-model", "latency"]
    code, out, _ = run(capsys, argv + ["--budget", "2048", "--vpp", "1", "--ranks-per-node", "8"])
    assert code == 0 and "8 ranks per node" in out and "two tiers shorter in" in out


def test_benchmark_json(monkeypatch, capsys):
    argv = ["benchmark", "--workload", "4", "--no-timing", "--json", "--cost-model", "model"]
    code, out, _ = run(capsys, argv + ["--budget", "2048", "--vpp", "4"])
    data = json.loads(out)
    assert code == 0 and data["plan_time"] == [] and len(data["workloads"]) == 1
    case = data["workloads"][0]
    assert case["layout"]["vpp"] == 4 and case["layout"]["budget"] == 2048
    names = [r["scheduler"] for r in case["results"]]
    assert names[0] == "default_dynamic_cp" and len(names) == 3
    assert case["results"][0]["num_microbatches"] % 4 == 0


def test_benchmark_and_simulate_take_a_cost_profile(tmp_path, capsys):
    from megatron_dcp.scheduling import CostModel
    from megatron_dcp.scheduling.cost_fit import CostProfile, save_profile

    path = tmp_path / "p.json"
    save_profile(str(path), CostProfile(CostModel(1e-6, 1e-10, 0.0, 1e-4, 1.0, "mine", 1e-3), {}))
    argv = ["benchmark", "--workload", "4", "--no-timing", "--budget", "4096", "--vpp", "1"]
    code, out, _ = run(capsys, argv + ["--cost-profile", str(path)])
    assert code == 0 and "cost model 'profile mine'" in out
    code, out, _ = run(capsys, ["simulate", "--no-peer", "--cost-profile", str(path)])
    assert code == 0 and "profile mine" in out
    path.write_text("{}")
    code, _, err = run(capsys, ["simulate", "--cost-profile", str(path)])
    assert code == 2 and "--cost-profile=" in err and "megatron-dcp calibrate" in err


def fake_fuzz(monkeypatch, violations):
    module = types.ModuleType("megatron_dcp.tools.plan_fuzzer")
    def run_fuzz(cases, seed, progress):
        partial = types.SimpleNamespace(cases=cases, violations=violations)
        partial.violation_count = len(violations)
        progress(cases - 1, partial)
        return partial

    module.run_fuzz = run_fuzz
    monkeypatch.setitem(sys.modules, "megatron_dcp.tools.plan_fuzzer", module)


def test_fuzz_passes(monkeypatch, capsys):
    fake_fuzz(monkeypatch, [])
    code, out, _ = run(capsys, ["fuzz", "--cases", "7", "--seed", "3"])
    assert code == 0 and "7 cases, 0 violations" in out


def test_fuzz_fails_on_violations(monkeypatch, capsys):
    fake_fuzz(monkeypatch, ["case 4: sample 2 appears twice"])
    code, out, _ = run(capsys, ["fuzz", "--cases", "7"])
    assert code == 1 and "1 violations" in out and "sample 2 appears twice" in out


def test_render_table_alignment():
    table = compare.render_table(("a", "bb"), [("xyz", "1"), ("q", "22")], "lr")
    assert table.splitlines() == ["a    bb", "xyz   1", "q    22"]


def parsers_of(parser):
    """``parser`` and every subcommand parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += parsers_of(sub)
    return found


def test_every_flag_of_every_subcommand_has_help():
    from megatron_dcp.tools import plan_fuzzer, quickstart
    from megatron_dcp.tools.cli import calibrate

    parsers = [*parsers_of(cli.build_parser()), quickstart.build_parser()]
    parsers += [calibrate.calibration_parser(), plan_fuzzer.fuzz_parser()]
    names = {p.prog.split()[-1] for p in parsers}
    assert names >= {"simulate", "benchmark", "fuzz", "calibrate", "sft-corpus"}
    assert "megatron_dcp.tools.quickstart" in names
    missing = [
        f"{p.prog}: {'/'.join(action.option_strings) or action.dest}"
        for p in parsers
        for action in p._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and not (action.help and action.help.strip())
    ]
    assert missing == []
