"""``megatron-dcp estimate`` on lengths files (no torch): the verdict where DCP wins (short
sequences that static CP shards) and where it cannot help (one rank; sequences that need the
whole static group), the step rest added to every arm as link-sweep adds it, the JSON's fields,
and the refusals, each naming its flag."""

import json
import sys

import pytest

from megatron_dcp.scheduling.hardware import hardware_profile
from megatron_dcp.scheduling.model_shape import ModelShape
from megatron_dcp.tools.cli.estimate import estimate
from megatron_dcp.tools.cli.main import main
from megatron_dcp.tools.estimate.step_rest import (
    matmul_parameters,
    measured_step_rest,
    predicted_step_rest,
)

# bench-train's documents model (docs/performance.md): 2 layers, hidden 128, FFN 512, with the
# rest of bench-train's model (4 heads, 4096 tokens, vocabulary 1024) given.
SMALL = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "512",
         "--num-attention-heads", "4", "--seq-length", "4096", "--vocab-size", "1024"]  # fmt: skip


def lengths_file(tmp_path, lengths, name="lengths.txt"):
    path = tmp_path / name
    path.write_text("".join(f"{length}\n" for length in lengths))
    return str(path)


def run(tmp_path, lengths, *flags):
    """estimate on ``lengths`` with the CPU profile; the JSON it wrote."""
    out = tmp_path / "estimate.json"
    argv = ["--lengths", lengths_file(tmp_path, lengths), "--cost-model", "cpu", *SMALL]
    assert estimate([*argv, "--batches", "2", "--global-batch-size", "16", *flags,
                     "--json", str(out)]) == 0  # fmt: skip
    return json.loads(out.read_text())


def test_dcp_wins_where_static_cp_shards_short_sequences(tmp_path, capsys):
    """Static CP 4 splits 100-token sequences over 4 ranks (a ring pass and each rank's share of
    the per-sequence cost for every one); DCP keeps them whole."""
    result = run(tmp_path, [100, 120, 90, 300] * 8, "--nproc", "4")
    assert result["layout"]["cp_size"] == 4
    assert result["verdict"]["helps"] is True
    gain = result["speedups"]["dcp_over_static"]
    assert gain >= 1.05
    line = capsys.readouterr().out.splitlines()[-2]
    assert line.startswith(f"DCP is predicted {gain:.2f}× faster than static CP 4")
    assert "than dev's planner" in line
    assert result["arms"]["static"]["cp_size_histogram"] == {"4": 32}
    assert int(result["arms"]["dcp"]["cp_size_histogram"].get("1", 0)) > 0


def test_one_rank_cannot_help(tmp_path, capsys):
    """One rank: every arm runs every sequence whole on it; the verdict says so."""
    result = run(tmp_path, [100, 700, 1500, 2000], "--nproc", "1")
    assert result["verdict"]["helps"] is False
    assert result["speedups"]["dcp_over_static"] == pytest.approx(1.0)
    line = capsys.readouterr().out.splitlines()[-2]
    assert line.startswith("DCP will not help here: every sequence fits one rank's budget")


def test_sequences_that_need_the_whole_group_cannot_be_helped(tmp_path):
    """Every sequence longer than one rank's budget needs CP 2 in any plan: a tie, named."""
    result = run(tmp_path, [3000, 3500, 4000, 2500], "--nproc", "2")
    assert result["verdict"]["helps"] is False
    assert "100% of the tokens are in sequences longer than 2048 tokens" in (
        result["verdict"]["line"]
    )


def test_the_json_holds_every_arm_and_the_step_rest_added_as_link_sweep_adds_it(tmp_path):
    lengths = [100, 120, 90, 300] * 8
    result = run(tmp_path, lengths, "--nproc", "4", "--step-rest-ms", "500")
    assert set(result) >= {"source", "lengths", "layout", "cost_model", "step_rest", "arms",
                           "speedups", "verdict", "global_batches", "global_batch_size"}
    assert result["lengths"] == [lengths[:16], lengths[16:32]]
    assert result["step_rest"]["seconds"] == 0.5
    assert set(result["arms"]) == {"static", "dcp", "megatron_dev"}
    paths = {}
    for arm, figures in result["arms"].items():
        batches = figures["per_batch"]
        assert len(batches) == 2 and figures["batches_planned"] == 2
        for batch in batches:
            assert batch["step_time_s"] == pytest.approx(batch["critical_path"] + 0.5)
            assert batch["max_tokens_per_rank"] <= 2048
        assert figures["peak_tokens_per_rank"] == max(b["max_tokens_per_rank"] for b in batches)
        assert figures["step_time_s"] == pytest.approx(sum(b["step_time_s"] for b in batches) / 2)
        paths[arm] = sum(b["critical_path"] for b in batches)
    rest = 2 * 0.5
    assert result["speedups"]["dcp_over_static"] == pytest.approx(
        (paths["static"] + rest) / (paths["dcp"] + rest)
    )
    assert result["speedups"]["dcp_over_megatron_dev"] == pytest.approx(
        (paths["megatron_dev"] + rest) / (paths["dcp"] + rest)
    )


def test_a_long_step_rest_dilutes_the_gain_below_the_bar(tmp_path):
    """The same data: a gain of the forward-backward alone, shrunk by a large plan-independent
    part of the step, and the verdict names it."""
    lengths = [100, 120, 90, 300] * 8
    result = run(tmp_path, lengths, "--nproc", "4", "--step-rest-ms", "1e6")
    assert result["verdict"]["helps"] is False
    assert "the step rest, 1000000.0 ms" in result["verdict"]["line"]


def test_the_lengths_file_is_cycled_and_truncated_to_the_sequence_length(tmp_path):
    result = run(tmp_path, [100, 9000], "--seq-length", "4096")
    assert result["lengths"][0][:4] == [100, 4096, 100, 4096]
    assert any("truncated" in note for note in result["notes"])


def test_the_predicted_step_rest_is_the_all_reduce_and_the_optimizer():
    """docs/performance.md: 2.1 MB of fp32 gradients (0.53 M parameters) for this model; the
    all-reduce moves 2 × (R − 1) / R of them over one rank's link."""
    shape = ModelShape(hidden_size=128, ffn_hidden_size=512, num_layers=2, num_attention_heads=4,
                       num_query_groups=4, vocab_size=1024, gated_mlp=False)  # fmt: skip
    assert matmul_parameters(shape) == 524288
    cpu = hardware_profile("cpu-gloo")
    rest = predicted_step_rest(shape, cpu, ranks=2, global_batch_size=32)
    assert rest.all_reduce_s == pytest.approx(524288 * 4 / cpu.link_bandwidth)
    assert rest.host_s == pytest.approx(18.9e-3 + 32 * 0.67e-3)  # CPU: between the steps
    assert rest.seconds == pytest.approx(rest.all_reduce_s + rest.optimizer_s + rest.host_s)
    assert predicted_step_rest(shape, cpu, ranks=1).all_reduce_s == 0.0
    gpu = predicted_step_rest(shape, hardware_profile("h100-eager"), ranks=2, global_batch_size=32)
    assert gpu.host_s == 0.0  # prefetched while the step runs


def test_the_measured_step_rest_is_read_as_link_sweep_reads_it(tmp_path):
    steps = [{"batch": b, "arm": "dcp", "step_ms": 100.0 + b, "fwd_bwd_ms": 60.0} for b in range(4)]
    path = tmp_path / "bench_train.json"
    path.write_text(json.dumps({"warmup": 1, "steps": steps}))
    assert measured_step_rest(str(path)).seconds == pytest.approx(0.042)
    path.write_text("{}")
    with pytest.raises(ValueError, match="--step-rest-from=.*bench_train.json"):
        measured_step_rest(str(path))


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "no data source: give one of --data-path"),
        (["--lengths", "L", "--sft-data", "c.jsonl"],
         "--lengths='L' and --sft-data='c.jsonl': give exactly one data source"),
        (["--sft-data", "c.jsonl"], "--sft-data=c.jsonl: .*add --tokenizer-model DIR"),
        (["--sft-data", "c.jsonl", "--tokenizer-type", "GPT2BPETokenizer"],
         "--tokenizer-type=GPT2BPETokenizer: .*HuggingFaceTokenizer"),
        (["--lengths", "L", "--nproc", "4", "--context-parallel-size", "8"],
         "--context-parallel-size=8: must divide the 4 DP×CP ranks"),
        (["--lengths", "L", "--nproc", "3", "--tensor-model-parallel-size", "2"],
         "--nproc=3: not a multiple of TP × PP = 2"),
        (["--lengths", "L", "--min-gain", "0.5"], "--min-gain=0.5"),
        (["--lengths", "L", "--cost-model", "cpu", "--hardware-profile", "h100-nvlink"],
         "--cost-model cpu with --hardware-profile=h100-nvlink"),
    ],
)  # fmt: skip
def test_bad_input_names_the_flag(tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    lengths_file(tmp_path, [100, 200], name="L")
    with pytest.raises(ValueError, match=message):
        estimate([*flags, *SMALL])


def test_a_sequence_no_plan_holds_names_the_budget(tmp_path):
    path = lengths_file(tmp_path, [100, 4096])
    with pytest.raises(ValueError, match="--max-seqlen-per-dp-cp-rank"):
        estimate(["--lengths", path, "--nproc", "1", "--batches", "1", "--global-batch-size", "2",
                  *SMALL])  # fmt: skip


def test_a_hugging_face_dataset_without_the_datasets_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match="--hf-dataset=json: .*pip install datasets"):
        estimate(["--hf-dataset", "json", "--data-files", "x.jsonl", "--text-field", "text",
                  *SMALL])  # fmt: skip


def test_main_exits_2_with_the_flag_on_stderr(capsys):
    assert main(["estimate", "--nproc", "2", "--model-preset", "bench-train"]) == 2
    assert "megatron-dcp estimate: error: no data source" in capsys.readouterr().err


def test_every_flag_has_help():
    from megatron_dcp.tools.cli.estimate import estimate_parser

    parser = estimate_parser()
    missing = [a.dest for a in parser._actions if not (a.help and a.help.strip())]
    assert missing == []


def test_long_planning_shows_a_progress_line_on_stderr(tmp_path, monkeypatch, capsys):
    from megatron_dcp.tools.cli import estimate as command

    monkeypatch.setattr(command, "PROGRESS_AFTER_S", 0.0)
    run(tmp_path, [100, 300])
    captured = capsys.readouterr()
    assert "estimate: 2/2 global batches" in captured.err
    assert "global batches" not in captured.out.splitlines()[-2]
