"""The constants of ``default_dynamic_cp`` live in one frozen ``Knobs`` read through the context:
no module of ``scheduling/dynamic_cp/`` defines a numeric constant of its own, and a scheduler
with other knobs plans with them."""

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.scheduling.dynamic_cp import DefaultDynamicCPScheduler, Knobs
from megatron_dcp.scheduling.dynamic_cp import knobs as knobs_module
from megatron_dcp.scheduling.metrics import critical_path

PACKAGE = Path(knobs_module.__file__).parent


def numeric_globals(path: Path):
    """Module-level names bound to a number literal (tuning constants) in ``path``."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            if isinstance(value, ast.UnaryOp):
                value = value.operand
            if isinstance(value, ast.Constant) and type(value.value) in (int, float):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [f"{path.name}: {ast.unparse(t)}" for t in targets]
    return found


def test_no_module_of_the_planner_holds_a_tuning_constant():
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "knobs.py"]
    assert files
    assert [name for path in files for name in numeric_globals(path)] == []


def test_the_scan_finds_a_planted_constant(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("MIN_GAIN = 1e-4\nLIMIT: int = -3\nNAME = 'x'\n")
    assert numeric_globals(planted) == ["planted.py: MIN_GAIN", "planted.py: LIMIT"]


def test_knobs_are_frozen_and_keyword_only():
    knobs = Knobs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        knobs.min_gain = 0.0
    with pytest.raises(TypeError):
        Knobs(1e-9)


def test_a_scheduler_plans_with_its_knobs():
    """Without the search (no batch is small enough for it) this batch plans 3 % longer: the
    knobs reach the planner through the context."""

    class Unsearched(DefaultDynamicCPScheduler):
        knobs = Knobs(search_samples=0)

    cost = build_cost_model("latency")
    lengths = [4096, 3000, 2500, 900, 800, 700, 512, 300, 200, 100, 90, 64] * 3
    kwargs = dict(dp_size=8, cp_size=1, max_seqlen_per_dp_cp_rank=2048, cost_model=cost)
    searched = DefaultDynamicCPScheduler(**kwargs).schedule(lengths)
    unsearched = Unsearched(**kwargs).schedule(lengths)
    assert critical_path(unsearched, cost) > 1.02 * critical_path(searched, cost)
