"""The link-rate sweep's report on synthetic runs written by the test: the reader (link object,
link.json or none; FLOPs per byte per rank; the model's predicted speedup from the plans'
critical paths over the compared batches; the distance to the limit), the markdown table, each
communication target met and not met, and the command writing its picture."""

import json

import pytest

from megatron_dcp.tools.bench_train.stats import Interval
from megatron_dcp.tools.cli.main import main
from megatron_dcp.tools.link_sweep.runs import flops_per_byte, read_run, read_sweep
from megatron_dcp.tools.link_sweep.sweep_table import markdown_table
from megatron_dcp.tools.link_sweep.targets import H100_NVLINK, check_targets

ARMS = ("static", "dcp", "megatron_dev")
# Per arm: critical path (s) per batch, and measured busiest fwd-bwd (ms) per batch.
PATHS = {"static": [9.0, 2.0, 3.0, 4.0], "dcp": [1.0, 1.0, 2.0, 2.0], "megatron_dev": [5.0, 2.0, 3.0, 3.0]}
FWD_BWD = {"static": [0, 2400, 3300, 4400], "dcp": [0, 1200, 2000, 2400], "megatron_dev": [0, 2000, 3000, 3000]}
BOUND = [1.0, 1.0, 2.0, 2.0]


def interval(value, low, high):
    return {"value": value, "low": low, "high": high}


def bench_record(link=None, nproc=2, error=0.05, agree=(9, 10), dcp=(1.5, 1.2, 1.8),
                 dev=(1.1, 1.0, 1.2), over_dev=(1.3, 1.1, 1.5), rest_ms=None):
    steps = [
        {"iteration": 3 * b + i + 1, "batch": b, "arm": arm,
         "step_ms": 1.0 if rest_ms is None else FWD_BWD[arm][b] + rest_ms,
         "fwd_bwd_ms": FWD_BWD[arm][b], "predicted_ms": 1.0, "plan": {}}
        for b in range(4) for i, arm in enumerate(ARMS)
    ]
    summaries = {
        "static": {"speedup": None},
        "dcp": {"speedup": interval(*dcp)},
        "megatron_dev": {"speedup": interval(*dev)},
    }
    record = {
        "arms": list(ARMS), "steps": steps, "summaries": summaries, "warmup": 1,
        "ordering": {"clear_agree": agree[0], "clear_total": agree[1], "close_agree": 0,
                     "close_total": 0},
        "errors": {"5-30": error}, "dcp_over": {"megatron_dev": interval(*over_dev)},
        "nproc": nproc, "oversubscribed": nproc > 2, "flags": [], "unavailable": {},
    }
    if link is not None:
        record["link"] = link
    return record


def write_run(folder, name, link_json=None, **kwargs):
    run = folder / name
    run.mkdir(parents=True)
    (run / "bench_train.json").write_text(json.dumps(bench_record(**kwargs)))
    plans = [
        {"batch": b, "arms": {a: {"critical_path_s": PATHS[a][b], "lower_bound_s": BOUND[b]}
                              for a in ARMS}}
        for b in range(4)
    ]
    (run / "plans.jsonl").write_text("".join(json.dumps(p) + "\n" for p in plans))
    if link_json is not None:
        (run / "link.json").write_text(json.dumps(link_json))
    return run


SHAPED = {"requested": "80mbit", "requested_bytes_per_s": 1e7, "probed_bytes_per_s": 9.6e6, "nodes": 1}


def test_the_reader_takes_the_link_object_and_prices_flops_per_byte_per_rank(tmp_path):
    run = read_run(write_run(tmp_path, "long_80mbit_r2", link=SHAPED), {})
    assert (run.workload, run.link.rate, run.tag) == ("long", "80mbit", "r2")
    # One shaped loopback: both ranks share one bucket of 9.6 MB/s.
    assert flops_per_byte(run, 1.92e11) == pytest.approx(1.92e11 / 4.8e6)
    two_nodes = {**SHAPED, "nodes": 2}
    run = read_run(write_run(tmp_path, "long_80mbit_2nodes", link=two_nodes, nproc=4), {})
    assert flops_per_byte(run, 1.92e11) == pytest.approx(1.92e11 / 4.8e6)


def test_a_run_without_a_link_object_reads_link_json_else_counts_as_unshaped(tmp_path):
    by_hand = read_run(write_run(tmp_path, "documents_80mbit", link_json=SHAPED), {})
    assert by_hand.link.probed_bytes_per_s == 9.6e6
    bare = read_run(write_run(tmp_path, "documents_unshaped"), {})
    assert (bare.link.rate, bare.link.bytes_per_s, flops_per_byte(bare, 1e11)) == ("unshaped", None, None)
    probed = read_run(bare_folder := tmp_path / "documents_unshaped", {"loopback_bytes_per_s": 4e8})
    assert flops_per_byte(probed, 1e11) == pytest.approx(1e11 / 2e8) and bare_folder.is_dir()


def test_the_predicted_speedup_sums_critical_paths_over_the_compared_batches_only(tmp_path):
    run = read_run(write_run(tmp_path, "documents_unshaped"), {})
    # Batch 0 is the warm-up (static 9 s against 1 s there would give 3.0 with it).
    assert run.predicted["dcp"] == pytest.approx(9.0 / 5.0)
    assert run.predicted["megatron_dev"] == pytest.approx(9.0 / 8.0)


def test_the_part_of_a_step_no_plan_changes_enters_the_prediction(tmp_path):
    """A measured step is the forward-backward plus a rest every arm pays alike (the gradient
    all-reduce, the optimizer): 0.5 s per compared batch dilutes the predicted speedup."""
    run = read_run(write_run(tmp_path, "documents_300mbit", rest_ms=500.0), {})
    assert run.remainder_s == pytest.approx(0.5)
    assert run.predicted["dcp"] == pytest.approx((9.0 + 1.5) / (5.0 + 1.5))
    assert markdown_table([run], None)[2].endswith("| 500 |")


def test_the_distance_to_the_limit_is_the_median_of_measured_over_bound(tmp_path):
    run = read_run(write_run(tmp_path, "documents_unshaped"), {})
    assert run.distance["static"] == pytest.approx(2.2)  # 2.4, 1.65, 2.2
    assert run.distance["dcp"] == pytest.approx(1.2)  # 1.2, 1.0, 1.2


def test_the_table_has_one_row_per_run_with_the_link_and_the_intervals(tmp_path):
    write_run(tmp_path, "documents_80mbit", link=SHAPED)
    write_run(tmp_path, "documents_unshaped")
    write_run(tmp_path, "documents_1gbit", link={**SHAPED, "requested": "1gbit", "probed_bytes_per_s": 1.2e8})
    lines = markdown_table(read_sweep(tmp_path), 1.92e11)
    assert len(lines) == 5 and all(line.count("|") == lines[0].count("|") for line in lines)
    unshaped, fast, shaped = lines[2:]  # fastest link first
    assert "| documents | unshaped |" in unshaped and "| documents | 1gbit |" in fast
    assert "| 9.6 | 4e+04 | 1.500 [1.200, 1.800] | 1.100 [1.000, 1.200] |" in shaped
    assert "| 1.800 (1.125) | 5.0% | 9/10 | 2.20, 1.20, 1.50 |" in shaped


def targets_of(tmp_path, **kwargs):
    write_run(tmp_path, "long_80mbit", link=SHAPED, **kwargs)
    return {t.name.split(":")[0].split(" (")[0]: t for t in check_targets(read_sweep(tmp_path), 1.92e11)}


def test_every_target_is_met_by_a_good_run(tmp_path):
    targets = targets_of(tmp_path, dcp=(1.7, 1.4, 2.0))
    assert all(t.met for t in targets.values()), [t.line() for t in targets.values()]


@pytest.mark.parametrize(
    "flaw, target",
    [
        ({"dcp": (0.9, 0.85, 0.97)}, "never slower"),
        ({"over_dev": (0.95, 0.9, 0.99)}, "never slower"),
        ({"dcp": (1.3, 1.2, 1.4)}, "within 15% of prediction where predicted ≥ 1.10"),
        ({"over_dev": (1.1, 0.99, 1.2)}, "DCP over dev, whole interval > 1, at some communication-bound rate"),
        ({"error": 0.16}, "model error ≤ 15% in every run"),
        ({"agree": (8, 10)}, "order agreement ≥ 90% where the predicted gap is ≥ 10 %"),
    ],
)
def test_each_target_fails_on_its_own_flaw(tmp_path, flaw, target):
    targets = targets_of(tmp_path, **{"dcp": (1.7, 1.4, 2.0), **flaw})
    assert not targets[target].met, targets[target].line()


def test_dcp_over_dev_counts_only_at_communication_bound_rates(tmp_path):
    fast = {**SHAPED, "probed_bytes_per_s": 1.92e11 / H100_NVLINK * 2 * 1.5}  # below the mark
    write_run(tmp_path, "long_fast", link=fast)
    target = check_targets(read_sweep(tmp_path), 1.92e11)[2]
    assert not target.met and "0/0" in target.detail


def test_the_command_prints_the_table_and_targets_and_writes_the_picture(tmp_path, capsys):
    write_run(tmp_path, "documents_unshaped", link_json={"requested": "unshaped", "probed_bytes_per_s": 8e8})
    write_run(tmp_path, "documents_80mbit", link=SHAPED)
    write_run(tmp_path, "documents_80mbit_r2", link=SHAPED, dcp=(1.6, 1.3, 1.9))
    (tmp_path / "machine.json").write_text(json.dumps({"flops_per_s": 1.92e11}))
    assert main(["link-sweep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "192.0 GFLOP/s" in out and "| documents | 80mbit | r2 |" in out and "MET: " in out
    png = tmp_path / "link_sweep.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_refuses_a_folder_without_runs(tmp_path, capsys):
    assert main(["link-sweep", str(tmp_path)]) == 2
    assert "no bench_train.json under it" in capsys.readouterr().err
    assert main(["link-sweep", str(tmp_path), "--flops-per-s", "-1"]) == 2
    assert "--flops-per-s=-1.0" in capsys.readouterr().err


def test_intervals_read_back_as_intervals(tmp_path):
    run = read_run(write_run(tmp_path, "sft_unshaped"), {})
    assert run.speedup["dcp"] == Interval(1.5, 1.2, 1.8) and run.dcp_over_dev.low == 1.1
