"""``megatron-dcp check`` end to end on 2 CPU ranks (the default here: the cores): it passes on
this machine with one verdict line, its DCP arm planned a mix of CP sizes and its static arms
static CP only (``testing.plan_coverage`` on the run's own log), the model trained is the one
its flags ask for (megatron's parameter count against ``testing.model_size``), and its reference
arm compared both arms' loss and gradients; and with each defect of
``tools.check.planted_defects`` planted (the worker's test-only ``MEGATRON_DCP_CHECK_DEFECT``) it
fails through the numeric comparison, with exit status 1 and one FAIL line naming the quantity.
One passing run is shared by the tests of this file."""

import json
import os
import subprocess
import sys

import pytest

from megatron_dcp.testing.model_size import check_model_size, flags_of
from megatron_dcp.testing.plan_coverage import Layout, RanPlan, assert_covers, training_run_plan
from megatron_dcp.tools.bench_train.arms import arm_at
from megatron_dcp.tools.check.reordered import CHECK_ARMS
from megatron_dcp.tools.launching.training_runs import parse_log

TIMEOUT_S = 300


def run_check(out, *flags, **env):
    command = [sys.executable, "-m", "megatron_dcp.tools", "check", "--nproc", "2", *flags]
    command += ["--out", str(out), "--json", str(out / "check.json")]
    return subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def checked(out, *flags):
    """A check's run: (the process, its folder, its JSON report), asserted to have passed."""
    done = run_check(out, *flags)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, out, json.loads((out / "check.json").read_text())


@pytest.fixture(scope="module")
def passed(tmp_path_factory):
    return checked(tmp_path_factory.mktemp("check"))


def test_check_passes_here_with_one_verdict_line(passed):
    done, _, report = passed
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("megatron-dcp check: PASS: static CP and DCP equal the reference")
    assert sum(line.startswith("megatron-dcp check:") for line in lines) == 1
    assert lines[0] == "environment" and "megatron-core 0.19.2 (supported)" in done.stdout
    assert report["passed"] and report["verdict"] == lines[-1]
    assert report["environment"]["devices"]["backend"] == "gloo"
    (layout,) = report["layouts"]
    assert layout["gradients"]["compared"] > 0 and layout["failures"] == []
    assert all(d["passed"] and d["noise"] >= 0 for d in layout["loss"])
    reference = layout["reference"]
    assert reference["error"] is None and reference["compared"] > layout["gradients"]["compared"]
    assert all(d["passed"] and d["decidable"] for d in reference["worst"])
    assert "static against the reference" in done.stdout
    assert "dcp against the reference" in done.stdout


@pytest.fixture(scope="module")
def passed_bf16(tmp_path_factory):
    return checked(tmp_path_factory.mktemp("check_bf16"), "--bf16")


def test_check_passes_in_bf16_deciding_what_bf16_resolves_and_the_rest_in_fp32(passed_bf16):
    done, out, report = passed_bf16
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("megatron-dcp check: PASS: bf16: static CP and DCP equal the ")
    assert "; fp32: static CP and DCP equal the reference" in lines[-1]
    assert report["stages"] == ["bf16", "fp32"]
    low, high = report["layouts"]
    assert (low["stage"], high["stage"]) == ("bf16", "fp32")
    assert low["failures"] == high["failures"] == []
    assert "--bf16" in low["training_flags"] and "--bf16" not in high["training_flags"]
    decided = low["reference"]["compared"] - low["reference"]["deferred_to_fp32"]
    assert decided >= low["reference"]["compared"] / 2, "bf16 decided under half the quantities"
    # each stage ran its precision: bf16 rounding is thousands of times float32's
    assert low["reference"]["max_relative"] > 1e3 * high["reference"]["max_relative"]
    log = parse_log((out / "bf16" / "cp2" / "train.log").read_text())
    assert_covers(arm_plans(log, "dcp", training_run_plan(log).layout), Layout(cp=2), mix_of=(1, 2))


def arm_plans(log, arm, layout):
    """What ``arm``'s iterations of the run planned (their ``[DCP]`` lines), on ``layout``."""
    iterations = [i for i in sorted(log.dcp) if arm_at(i, CHECK_ARMS)[1] == arm]
    sizes = tuple(tuple(log.dcp[i].cp_sizes) for i in iterations)
    return RanPlan(sizes, None, layout)


def test_the_run_covered_a_mix_of_cp_sizes_on_the_model_its_flags_ask_for(passed):
    _, out, report = passed
    log = parse_log((out / "cp2" / "train.log").read_text())
    layout = training_run_plan(log).layout
    assert_covers(arm_plans(log, "dcp", layout), Layout(cp=2), mix_of=(1, 2))
    for static in ("static", "static_reordered"):
        assert_covers(arm_plans(log, static, layout), Layout(cp=2), cp_sizes={2})
    check_model_size(flags_of(report["layouts"][0]["training_flags"]), log.parameters)


# Planted defects (``tools.check.planted_defects``), each a change of numbers, never a crash,
# checked in bf16 (a GPU's default: two stages, ``tools.check.stages``): the FAIL must come from
# the numeric comparison of the stage that can see the defect and name where it shows.
DIFFERS = "differs from the reference by"
DEFECTS = {  # defect: (the stage that decides it, what the FAIL line says)
    "zigzag_chunks_swapped": ("bf16", DIFFERS),  # CP sizes > 1 only
    "labels_shifted": ("bf16", DIFFERS),  # every plan shares it
    "loss_mask_shifted": ("bf16", DIFFERS),  # as many loss tokens, not the same ones
    # a wrong normaliser: the count differs; the gradients' 1/2000 is below bf16's resolution
    "loss_tokens_off_by_one": ("bf16", "tokens, the reference"),
    "attention_entry_scaled": ("fp32", DIFFERS),  # 2**-10: below bf16's resolution
}


def tensor_of(difference):
    """The quantity of a finding named ``batch <b> <arm> rank<r> <quantity>``."""
    return difference["name"].split(" ", 4)[4]


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_a_planted_defect_fails_the_bf16_check_through_its_numbers(tmp_path, defect):
    stage, says = DEFECTS[defect]
    done = run_check(tmp_path, "--bf16", MEGATRON_DCP_CHECK_DEFECT=defect)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert lines[-1].startswith(f"megatron-dcp check: FAIL: {stage} cp2: ")
    assert says in lines[-1] and "training failed" not in lines[-1]
    report = json.loads((tmp_path / "check.json").read_text())
    layout = report["layouts"][-1]
    assert layout["stage"] == stage and [d["stage"] for d in report["layouts"]][0] == "bf16"
    assert layout["error"] is None and layout["reference"]["error"] is None
    if says != DIFFERS:
        return
    worst = layout["reference"]["worst"][0]
    assert not worst["passed"] and tensor_of(worst) in lines[-1]  # the tensor named
    failing = {tensor_of(d) for d in layout["reference"]["worst"] if not d["passed"]}
    assert failing - {"loss"}, "no gradient tensor differs from the reference"
    if stage == "bf16":  # the float32 stage runs only after a bf16 stage that found nothing
        assert "check: fp32 stage not run: the bf16 stage failed" in done.stdout
    if defect.startswith(("labels", "loss_mask")):  # common to every plan: the reference sees it
        assert "differs from static CP" not in lines[-1]
