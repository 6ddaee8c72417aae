"""``megatron-dcp check`` end to end on 2 CPU ranks (the default here: the cores): it passes on
this machine with one verdict line, its DCP arm planned a mix of CP sizes and its static arms
static CP only (``testing.plan_coverage`` on the run's own log), the model trained is the one
its flags ask for (megatron's parameter count against ``testing.model_size``); and with one
patch-table entry turned into a no-op (the worker's test-only ``MEGATRON_DCP_CHECK_NOOP_PATCH``:
``attention_rope``, RoPE on the static CP group) it fails, with exit status 1 and one FAIL line.
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


def test_a_patch_entry_made_a_no_op_fails_the_check(tmp_path):
    done = run_check(tmp_path, MEGATRON_DCP_CHECK_NOOP_PATCH="attention_rope")
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert lines[-1].startswith("megatron-dcp check: FAIL: cp2: ")
    report = json.loads((tmp_path / "check.json").read_text())
    assert not report["passed"] and report["layouts"][0]["failures"]
