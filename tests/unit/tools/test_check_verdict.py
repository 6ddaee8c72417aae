"""``megatron-dcp check``'s judgement on synthetic findings, pure Python: the tolerance rule and
the verdict (a difference beyond it from static CP or from the reference arm, a tolerance over
the ceiling, a reference arm that failed or compared nothing, a plan without a mix of CP sizes,
unequal token counts, a failed run each FAIL), the refusals before anything runs, the flags the
check sets itself."""

import pytest

from megatron_dcp.tools.check.layout_runs import Layout, LayoutResult, layouts_for
from megatron_dcp.tools.check.tolerance import (
    ERROR_FACTOR,
    FLOAT32_EPS,
    FLOOR_ULPS,
    CEILING,
    Difference,
    tolerance,
)
from megatron_dcp.tools.check.verdict import failures, verdict_line
from megatron_dcp.tools.cli.check import refusal, training_flags

SPEED = {"static_step_ms": 2.0, "dcp_step_ms": 1.0, "dcp_speedup": 2.0, "dcp_tokens_per_s": 9.0,
         "static_tokens_per_s": 4.5, "batches": 2.0, "oversubscribed": 0.0}  # fmt: skip


def passing(layout=Layout(1, 2)):
    sizes = {"static": [[2], [2]], "static_reordered": [[2], [2]], "dcp": [[1], [1, 2]]}
    result = LayoutResult(layout, cp_sizes=sizes, speed=SPEED)
    result.tokens = {arm: [100, 120] for arm in sizes}
    result.loss = [Difference("batch 0 loss", 500.0, 1e-4, 2e-4)]
    result.gradients = [Difference("batch 0 rank0 w", 1.0, 1e-7, 3e-7)]
    result.reference = [
        Difference(f"batch 0 {arm} rank0 w", 1.0, 1e-7, 2e-7, runs=1) for arm in ("static", "dcp")
    ]
    return result


def test_tolerance_is_the_oracle_rule_with_its_floor():
    assert tolerance(1e-6, 1.0) == ERROR_FACTOR * 1e-6
    assert tolerance(0.0, 2.0) == ERROR_FACTOR * FLOOR_ULPS * FLOAT32_EPS * 2.0
    d = Difference("w", magnitude=1.0, noise=1e-6, difference=1e-5)
    assert d.allowed == 2 * ERROR_FACTOR * 1e-6 and d.passed and d.margin == pytest.approx(0.625)
    assert Difference("zero", 0.0, 0.0, 0.0).margin == 0.0
    assert not Difference("zero", 0.0, 0.0, 1e-30).passed


def test_a_passing_run_gives_one_pass_line_with_its_figures():
    result = passing()
    assert failures(result) == []
    line = verdict_line([result], [])
    assert line.startswith("megatron-dcp check: PASS: static CP and DCP equal the reference ")
    assert "gradients max rel. diff 2.0e-07 (at most 0.05 of the tolerance)" in line
    assert "DCP equals static CP: loss 4.0e-07, gradients 3.0e-07" in line
    assert "smoke speed, not a benchmark" in line


@pytest.mark.parametrize("factor", [10.0, 1e4])
def test_a_gradient_beyond_the_tolerance_fails(factor):
    result = passing()
    noise = result.gradients[0].noise
    allowed = 2 * tolerance(noise, 1.0)
    result.gradients.append(Difference("batch 1 rank1 w", 1.0, noise, allowed * factor / 8))
    found = failures(result)
    assert len(found) == 1 and "batch 1 rank1 w differs from static CP" in found[0]
    assert verdict_line([result], found).startswith("megatron-dcp check: FAIL: cp2: batch 1")


def test_a_loss_beyond_the_tolerance_fails():
    result = passing()
    result.loss.append(Difference("batch 1 loss", 500.0, 1e-4, 1.0))
    assert any("batch 1 loss differs" in f for f in failures(result))


def test_a_run_without_a_mix_of_cp_sizes_fails():
    result = passing()
    result.cp_sizes["dcp"] = [[2], [2]]  # the planner returned static plans
    expected = "cp2: DCP planned one CP size per batch ([2] [2]): no mix was checked"
    assert failures(result) == [expected]


def test_unequal_token_counts_and_a_failed_run_fail():
    result = passing()
    result.tokens["dcp"] = [100, 119]
    assert any("different loss tokens" in f for f in failures(result))
    crashed = LayoutResult(Layout(2, 2), error="training exited with 1: RuntimeError: boom\n...")
    expected = "pp2·cp2: training failed: training exited with 1: RuntimeError: boom"
    assert failures(crashed) == [expected]


def test_layouts_add_a_pipeline_from_four_ranks():
    assert layouts_for(2) == [Layout(1, 2)]
    assert layouts_for(4) == [Layout(1, 4), Layout(2, 2)]
    assert layouts_for(3) == [Layout(1, 3)]


def environment(gpus=(), te=None, version="0.19.2", supported=True):
    return {
        "megatron_core": {"version": version, "supported": supported, "supports": ["0.19.x"]},
        "devices": {"gpus": list(gpus)},
        "transformer_engine": te,
    }


def test_refusals_name_the_reason():
    assert refusal(environment(), 2) is None
    assert refusal(environment(gpus=["H200"] * 2, te="2.9"), 2) is None
    one_gpu = refusal(environment(gpus=["H200"]), 1)
    assert "--nproc=1: a DP×CP domain of one rank" in one_gpu
    assert "no Transformer Engine" in one_gpu and "\n" not in one_gpu
    assert "this machine has 1 GPU(s)" in refusal(environment(gpus=["H200"], te="2.9"), 2)
    assert "not supported" in refusal(environment(version="0.20.0", supported=False), 2)


def test_the_check_sets_the_layout_learning_rate_and_dropout():
    flags = training_flags(["--num-layers", "4"], on_gpu=False)
    assert flags[flags.index("--lr") + 1] == "0.0" and "--bf16" not in flags
    assert flags.count("--num-layers") == 1 and flags[-2:] == ["--num-layers", "4"]
    assert "--bf16" in training_flags([], on_gpu=True)
    with pytest.raises(ValueError, match="--context-parallel-size, --lr: check sets these"):
        training_flags(["--lr", "1e-4", "--context-parallel-size=2"], on_gpu=False)


@pytest.mark.parametrize("arm", ["static", "dcp"])
def test_an_arm_away_from_the_reference_fails_naming_tensor_and_rank(arm):
    result = passing()
    noise = 1e-7
    allowed = tolerance(noise, 0.5)
    difference = Difference(f"batch 1 {arm} rank1 w2", 0.5, noise, 1.5 * allowed, runs=1)
    result.reference.append(difference)
    (found,) = failures(result)
    assert found.startswith(f"cp2: batch 1 {arm} rank1 w2 differs from the reference by ")
    assert "of its largest value 0.5" in found and "1.5x its tolerance" in found


def test_the_reference_tolerance_is_one_sided():
    d = Difference("w", magnitude=1.0, noise=1e-6, difference=1e-5, runs=1)
    assert d.allowed == ERROR_FACTOR * 1e-6 and d.margin == pytest.approx(1.25) and not d.passed


def test_a_tolerance_over_the_ceiling_cannot_decide():
    result = passing()
    bf16 = 2.0**-7
    noise = CEILING  # rounding as large as the ceiling: 8 times it is allowed
    result.reference.append(Difference("batch 0 dcp rank0 b", 1.0, noise, 0.0, runs=1, eps=bf16))
    (found,) = failures(result)
    assert found.startswith("cp2: cannot decide: batch 0 dcp rank0 b's tolerance is 0.4 of its")


def test_a_reference_arm_that_failed_or_compared_nothing_fails():
    result = passing()
    result.reference_error = "the reference arm failed: ValueError: boom"
    assert failures(result) == ["cp2: the reference arm failed: ValueError: boom"]
    result = passing()
    result.reference = []
    assert failures(result) == ["cp2: the reference arm compared nothing"]


def test_a_token_count_unlike_the_references_fails():
    result = passing()
    result.reference_tokens = ["batch 0 dcp rank0 loss: 101 tokens, the reference 100"]
    assert failures(result) == ["cp2: batch 0 dcp rank0 loss: 101 tokens, the reference 100"]
