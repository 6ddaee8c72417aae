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
from megatron_dcp.tools.launcher import parse_log

TIMEOUT_S = 300


def run_check(out, **env):
    command = [sys.executable, "-m", "megatron_dcp.tools", "check", "--nproc", "2"]
    command += ["--out", str(out), "--json", str(out / "check.json")]
    return subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.fixture(scope="module")
def passed(tmp_path_factory):
    out = tmp_path_factory.mktemp("check")
    done = run_check(out)
    return done, out, json.loads((out / "check.json").read_text())


def test_check_passes_here_with_one_verdict_line(passed):
    done, _, report = passed
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
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


# Planted defects (``tools.check.planted_defects``), each a change of numbers, never a crash:
# the FAIL must come from the numeric comparison and name where the defect shows.
DEFECTS = {
    "zigzag_chunks_swapped": "differs from the reference by",  # only CP sizes > 1 carry it
    "labels_shifted": "differs from the reference by",  # every plan shares it
    "loss_tokens_off_by_one": "tokens, the reference",  # the loss normalised by a wrong count
    "attention_entry_scaled": "differs from the reference by",  # one patch entry's numbers
}


def tensor_of(difference):
    """The quantity of a finding named ``batch <b> <arm> rank<r> <quantity>``."""
    return difference["name"].split(" ", 4)[4]


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_a_planted_defect_fails_the_check_through_its_numbers(tmp_path, defect):
    done = run_check(tmp_path, MEGATRON_DCP_CHECK_DEFECT=defect)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert lines[-1].startswith("megatron-dcp check: FAIL: cp2: ")
    assert DEFECTS[defect] in lines[-1] and "training failed" not in lines[-1]
    report = json.loads((tmp_path / "check.json").read_text())
    (layout,) = report["layouts"]
    assert layout["error"] is None and layout["reference"]["error"] is None
    worst = layout["reference"]["worst"][0]
    assert not worst["passed"] and tensor_of(worst) in lines[-1]  # the tensor named
    failing = {tensor_of(d) for d in layout["reference"]["worst"] if not d["passed"]}
    assert failing - {"loss"}, "no gradient tensor differs from the reference"
    if defect == "labels_shifted":  # DCP and static CP agree: only the reference arm sees it
        assert "differs from static CP" not in lines[-1]
