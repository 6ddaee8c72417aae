"""Property tests of the plan invariants (docs/architecture.md, "Plan invariants") for every
scheduler.

Each invariant is its own test and is asserted directly here (inputs: ``scheduling_strategies``);
``test_independent_checker_and_validate_agree`` runs the fuzz checker as well. An input a
scheduler rejects with ``ValueError`` passes only when the feasibility oracle
(:func:`megatron_dcp.tools.plan_check.rejection`) says no plan may exist, and the error must name
a flag. Plans must not depend on the process either (``PYTHONHASHSEED``).
"""

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import (
    BUDGET,
    NAMES,
    allowed_block,
    cases,
    cost_models,
    parametrize_names,
    plan_or_none,
    scaled,
)

from megatron_dcp.scheduling import build_scheduler
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
from megatron_dcp.tools.fuzz_cases import FuzzCase
from megatron_dcp.tools.plan_check import check_plan, check_static_cp

REPO = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------------------------
# One test per invariant, both schedulers
# ------------------------------------------------------------------------------------------------


@parametrize_names
@settings(max_examples=scaled(200), deadline=None)
@given(data=st.data())
def test_every_sample_appears_exactly_once(name, data):
    case = data.draw(cases(name))
    plan = plan_or_none(name, case)
    if plan is not None:
        ids = sorted(i for mb in plan.microbatches for g in mb.groups for i in g.sample_ids)
        assert ids == list(range(len(case.seqlens)))


COSTS = cost_models()


@parametrize_names
@settings(max_examples=scaled(100), deadline=None)
@given(data=st.data(), cost=COSTS)
def test_the_lower_bound_is_below_the_critical_path(name, data, cost):
    """Whatever the cost model (ring steps, CP efficiency), the lower bound is a true bound."""
    plan = plan_or_none(name, data.draw(cases(name)))
    if plan is not None and plan.seqlens:
        assert lower_bound(plan, cost) <= critical_path(plan, cost) * (1 + 1e-9)


@parametrize_names
@settings(max_examples=scaled(200), deadline=None)
@given(data=st.data())
def test_groups_partition_the_domain_in_every_microbatch(name, data):
    case = data.draw(cases(name))
    plan = plan_or_none(name, case)
    if plan is not None:
        for mb in plan.microbatches:
            assert sorted(r for g in mb.groups for r in g.ranks) == list(range(case.size))


@parametrize_names
@settings(max_examples=scaled(200), deadline=None)
@given(data=st.data())
def test_groups_are_aligned_blocks_with_a_cp_group(name, data):
    case = data.draw(cases(name))
    plan = plan_or_none(name, case)
    if plan is not None:
        for mb in plan.microbatches:
            for g in mb.groups:
                start, size = g.ranks[0], len(g.ranks)
                assert g.ranks == tuple(range(start, start + size))
                assert allowed_block(start, size, case.size, case.min_cp_size), g.ranks


@parametrize_names
@settings(max_examples=scaled(200), deadline=None)
@given(data=st.data())
def test_tokens_per_rank_stay_within_the_budget(name, data):
    case = data.draw(cases(name))
    plan = plan_or_none(name, case)
    if plan is not None:
        for mb in plan.microbatches:
            for g in mb.groups:
                tokens = sum(case.seqlens[i] for i in g.sample_ids)
                assert tokens <= case.budget * len(g.ranks)  # Σ len / |group| ≤ budget, exactly


@parametrize_names
@settings(max_examples=scaled(200), deadline=None)
@given(data=st.data())
def test_no_rank_is_idle(name, data):
    case = data.draw(cases(name))
    plan = plan_or_none(name, case)
    if plan is not None:
        assert all(g.sample_ids for mb in plan.microbatches for g in mb.groups)


@parametrize_names
@settings(max_examples=scaled(200), deadline=None)
@given(data=st.data())
def test_vpp_microbatch_count_is_a_multiple_of_the_group_size(name, data):
    case = data.draw(cases(name))
    plan = plan_or_none(name, case)
    if plan is not None:
        assert plan.microbatch_group_size_per_vp_stage == case.vpp
        if case.vpp:
            assert plan.num_microbatches % case.vpp == 0


@parametrize_names
@settings(max_examples=scaled(120), deadline=None)
@given(data=st.data())
def test_same_input_gives_the_same_plan(name, data):
    case = data.draw(cases(name))
    plan = plan_or_none(name, case)
    if plan is not None:
        scheduler = build_scheduler(name, **case.kwargs())
        for again in (
            scheduler.schedule(list(case.seqlens)),
            scheduler.schedule(tuple(case.seqlens)),
        ):
            assert again == plan and repr(again) == repr(plan)


@settings(max_examples=scaled(120), deadline=None)
@given(case=cases("dp_balanced"))
def test_dp_balanced_uses_only_static_cp_blocks(case):
    plan = plan_or_none("dp_balanced", case)
    if plan is not None:
        assert check_static_cp(plan, case.cp_size) == []


@parametrize_names
@settings(max_examples=scaled(100), deadline=None)
@given(data=st.data())
def test_independent_checker_and_validate_agree(name, data):
    """Larger inputs (up to 120 lengths) through the fuzz checker and ``Plan.validate``."""
    case = data.draw(cases(name, max_size=120))
    plan = plan_or_none(name, case)
    if plan is not None:
        assert check_plan(plan, case.seqlens, case.domain(), case.vpp) == []
        assert plan.validate() is plan


@parametrize_names
@settings(max_examples=scaled(120), deadline=None)
@given(data=st.data())
def test_sequence_longer_than_the_domain_raises_value_error(name, data):
    case = data.draw(cases(name, max_size=8))
    too_long = case.size * case.budget + data.draw(st.integers(1, case.budget))
    position = data.draw(st.integers(0, len(case.seqlens)))
    seqlens = list(case.seqlens)
    seqlens.insert(position, too_long)
    with pytest.raises(ValueError, match=BUDGET):
        build_scheduler(name, **case.kwargs()).schedule(seqlens)


# ------------------------------------------------------------------------------------------------
# Determinism across processes (no dict/set-order or hash dependence)
# ------------------------------------------------------------------------------------------------


def drawn(seed: int, count: int, low: int, high: int) -> tuple:
    rng = random.Random(seed)
    return tuple(rng.randint(low, high) for _ in range(count))


HASHSEED_CASES = [
    FuzzCase(2, 4, 64, 1, None, tuple([37] * 40 + [200, 255, 3, 1, 1, 1])),  # many ties
    FuzzCase(3, 1, 16, 1, 2, tuple(range(1, 17)) * 2),  # odd N, VPP
    FuzzCase(3, 4, 100, 4, None, drawn(5, 60, 1, 400)),  # min CP 4
    FuzzCase(1, 6, 30, 2, 3, tuple(random.Random(6).choices([1, 30, 179, 180], k=30))),  # N = 6
    FuzzCase(4, 2, 512, 1, None, drawn(7, 150, 1, 1024)),
]

_PLAN_DIGESTS = """
import hashlib, json, sys
from megatron_dcp.scheduling import build_scheduler
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
out = []
for name, kwargs, seqlens in json.loads(sys.stdin.read()):
    try:
        text = repr(build_scheduler(name, **kwargs).schedule(seqlens))
    except Exception as error:
        text = type(error).__name__ + ": " + str(error)
    out.append(hashlib.sha256(text.encode()).hexdigest())
print(json.dumps(out))
"""


def plan_digests_in_subprocess(jobs, hashseed: str):
    env = dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", _PLAN_DIGESTS],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    return json.loads(result.stdout)


def test_plans_do_not_depend_on_pythonhashseed():
    jobs = [(name, case.kwargs(), list(case.seqlens)) for case in HASHSEED_CASES for name in NAMES]
    reference = plan_digests_in_subprocess(jobs, "0")
    for hashseed in ("1", "123456789"):
        assert plan_digests_in_subprocess(jobs, hashseed) == reference, hashseed
    local = []
    for name, kwargs, seqlens in jobs:
        try:
            text = repr(build_scheduler(name, **kwargs).schedule(seqlens))
        except Exception as error:  # noqa: BLE001 - errors must be deterministic too
            text = type(error).__name__ + ": " + str(error)
        local.append(hashlib.sha256(text.encode()).hexdigest())
    assert local == reference
