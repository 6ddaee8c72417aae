"""Property tests of the plan invariants (DESIGN.md, "Plan invariants") for every scheduler.

Inputs: any domain size N = dp·cp in 1..64 (odd and non-powers of two included), power-of-two
minimum CP sizes, VPP group sizes None or 1..4, budgets 1..4096, and 0..N lengths mixing tiny,
typical and near-maximal (N·budget) sequences. Each invariant is its own test and is asserted
directly here; ``test_independent_checker_and_validate_agree`` runs the fuzz checker as well.

An input a scheduler rejects with ``ValueError`` passes only when the feasibility oracle
(:func:`megatron_dcp.tools.fuzz.rejection`) says no plan may exist, and the error must name
a flag. The regression tests at the end of this file pin fixed scheduler bugs (zero-length
samples, domains that only the whole-domain group tiles, VPP edge cases).
"""

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from megatron_dcp.scheduling import Plan, build_scheduler
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.tools.fuzz import MUST_REJECT, Case, check_plan, check_static_cp, rejection

# Scheduling errors name the scheduling parameters (the flags come from the layers above).
BUDGET, MIN_CP, VPP = "budget", "min_cp_size", "microbatch_group_size_per_vp_stage"

NAMES = ("default_dynamic_cp", "dp_balanced")
REPO = Path(__file__).resolve().parents[2]
INTERESTING_N = (1, 2, 3, 5, 6, 7, 8, 12, 24, 48, 63, 64)


def scaled(examples: int) -> int:
    """``examples`` under the ``ci`` profile, more under ``dev`` (see tests/conftest.py)."""
    return max(1, examples * settings().max_examples // 100)


def is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def allowed_block(start: int, size: int, n: int, min_cp: int) -> bool:
    """A CP group exists for ``[start, start + size)``."""
    whole = start == 0 and size == n
    return whole or (is_pow2(size) and size >= min_cp and start % size == 0 and start + size <= n)


# ------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------


@st.composite
def layouts(draw, static_cp: bool = False):
    """(dp, cp, budget, min_cp, vpp); with ``static_cp`` cp is a size dp_balanced accepts."""
    n = draw(st.one_of(st.integers(1, 64), st.sampled_from(INTERESTING_N)))
    min_cp = draw(st.sampled_from([1 << k for k in range(n.bit_length())]))
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    if static_cp:
        divisors = [d for d in divisors if d == n or (is_pow2(d) and d >= min_cp)]
    cp = draw(st.sampled_from(divisors))
    vpp = draw(st.one_of(st.none(), st.integers(1, 4)))
    budget = draw(st.one_of(st.integers(1, 4096), st.sampled_from([1, 2, 3, 7, 4096])))
    return n // cp, cp, budget, min_cp, vpp


def lengths(cap: int, budget: int, min_size: int = 0, max_size: int = 24):
    """Lists of tiny, typical (≤ budget), any (≤ cap) and near-maximal (cap − 2 .. cap)
    lengths."""
    one = st.one_of(
        st.integers(0, 3),
        st.integers(1, budget),
        st.integers(0, cap),
        st.integers(max(0, cap - 2), cap),
    )
    return st.lists(one, min_size=min_size, max_size=max_size)


@st.composite
def cases(draw, name: str, max_size: int = 40) -> Case:
    """A valid input for ``name``: lengths fit the largest group the scheduler can use. For
    dp_balanced, often enough samples to give every DP rank one per micro-batch."""
    dp, cp, budget, min_cp, vpp = draw(layouts(static_cp=name == "dp_balanced"))
    cap = (cp if name == "dp_balanced" else dp * cp) * budget
    min_size = 0
    if name == "dp_balanced" and draw(st.booleans()):
        min_size = dp * (vpp or 1)
    seqlens = draw(lengths(cap, budget, min_size, min_size + max_size))
    return Case(dp, cp, budget, min_cp, vpp, tuple(seqlens))


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def plan_or_none(name: str, case: Case) -> Optional[Plan]:
    """The plan; None when the input is legitimately rejected."""
    expected = rejection(name, case)
    try:
        plan = build_scheduler(name, **case.kwargs()).schedule(list(case.seqlens))
    except ValueError as error:
        assert isinstance(error, SchedulingError), f"{name}: not a SchedulingError: {error}"
        assert expected is not None, f"{name} rejected an input that has a plan: {error}"
        event("rejected (allowed)")
        return None
    assert expected != MUST_REJECT, f"{name} accepted an input that has no plan"
    event("planned")
    return plan


def schedule_kwargs(**overrides):
    kwargs = dict(dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8)
    kwargs.update(overrides)
    return kwargs


parametrize_names = pytest.mark.parametrize("name", NAMES)


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
# Explicit examples
# ------------------------------------------------------------------------------------------------


@parametrize_names
@pytest.mark.parametrize("vpp", [None, 3])
@pytest.mark.parametrize("dp,cp", [(1, 1), (2, 2), (3, 1), (1, 8)])
def test_empty_input_gives_an_empty_plan(name, vpp, dp, cp):
    scheduler = build_scheduler(
        name, **schedule_kwargs(dp_size=dp, cp_size=cp, microbatch_group_size_per_vp_stage=vpp)
    )
    plan = scheduler.schedule([])
    assert plan.num_microbatches == 0 and plan.microbatches == () and plan.seqlens == ()


@pytest.mark.parametrize(
    "dp,cp,min_cp", [(1, 1, 1), (2, 2, 1), (3, 1, 1), (3, 2, 2), (8, 8, 4), (7, 9, 1)]
)
def test_one_huge_sequence_fills_the_whole_domain(dp, cp, min_cp):
    budget = 5
    n = dp * cp
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=dp,
        cp_size=cp,
        max_seqlen_per_dp_cp_rank=budget,
        min_cp_size=min_cp,
    )
    plan = scheduler.schedule([n * budget])
    assert [[(g.ranks, g.sample_ids) for g in mb.groups] for mb in plan.microbatches] == [
        [(tuple(range(n)), (0,))]
    ]
    with pytest.raises(ValueError, match=BUDGET):
        scheduler.schedule([n * budget + 1])


@pytest.mark.parametrize("cp", [1, 2, 4, 6])
def test_dp_balanced_one_huge_sequence(cp):
    """With dp 1 the static CP group is the whole domain; with dp > 1 it cannot hold N·budget."""
    budget = 5
    whole = build_scheduler("dp_balanced", dp_size=1, cp_size=cp, max_seqlen_per_dp_cp_rank=budget)
    plan = whole.schedule([cp * budget])
    assert [[g.ranks for g in mb.groups] for mb in plan.microbatches] == [[tuple(range(cp))]]
    if is_pow2(cp):
        split = build_scheduler(
            "dp_balanced", dp_size=2, cp_size=cp, max_seqlen_per_dp_cp_rank=budget
        )
        with pytest.raises(ValueError, match=BUDGET):
            split.schedule([2 * cp * budget])


@parametrize_names
@settings(max_examples=scaled(120), deadline=None)
@given(data=st.data())
def test_all_lengths_zero_or_one(name, data):
    dp, cp, budget, min_cp, vpp = data.draw(layouts(static_cp=name == "dp_balanced"))
    seqlens = data.draw(st.lists(st.sampled_from([0, 1]), max_size=3 * dp * cp))
    case = Case(dp, cp, budget, min_cp, vpp, tuple(seqlens))
    plan = plan_or_none(name, case)
    if plan is not None:
        assert check_plan(plan, case.seqlens, case.domain(), vpp) == []


@settings(max_examples=scaled(120), deadline=None)
@given(layout=layouts(), data=st.data())
def test_fewer_sequences_than_ranks_expands_groups(layout, data):
    """default_dynamic_cp: with fewer samples than ranks, groups grow so that no rank idles."""
    dp, cp, budget, min_cp, _ = layout
    n = dp * cp
    seqlens = data.draw(lengths(n * budget, budget, min_size=1, max_size=max(1, n - 1)))
    case = Case(dp, cp, budget, min_cp, None, tuple(seqlens))
    plan = plan_or_none("default_dynamic_cp", case)
    if plan is not None:
        assert plan.num_microbatches <= len(seqlens)
        assert all(g.sample_ids for mb in plan.microbatches for g in mb.groups)
        assert all(sum(len(g.ranks) for g in mb.groups) == n for mb in plan.microbatches)


def test_dp_balanced_fewer_sequences_than_dp_ranks_raises():
    with pytest.raises(ValueError, match="more sequences in the batch"):
        build_scheduler("dp_balanced", dp_size=4, cp_size=2, max_seqlen_per_dp_cp_rank=8).schedule(
            [1, 2, 3]
        )


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 32, 64])
def test_min_cp_equal_to_the_domain_gives_whole_domain_groups(n):
    rng = random.Random(n)
    seqlens = [rng.randint(1, 3 * n) for _ in range(20)]
    for name in NAMES:
        plan = build_scheduler(
            name, dp_size=1, cp_size=n, max_seqlen_per_dp_cp_rank=4, min_cp_size=n
        ).schedule(seqlens)
        assert all(g.ranks == tuple(range(n)) for mb in plan.microbatches for g in mb.groups)
        assert check_plan(plan, tuple(seqlens), plan.domain, None) == []


@pytest.mark.parametrize("n,min_cp", [(6, 4), (12, 8), (24, 16), (63, 32)])
def test_min_cp_that_cannot_tile_the_domain_gives_whole_domain_groups(n, min_cp):
    """N not a multiple of min_cp: only the whole-domain group can partition the domain."""
    seqlens = [n * 4 - 1, 2 * n, n + 1, 5 * n // 2] * 3
    plan = build_scheduler(
        "default_dynamic_cp", dp_size=n, cp_size=1, max_seqlen_per_dp_cp_rank=4, min_cp_size=min_cp
    ).schedule(seqlens)
    assert all(g.ranks == tuple(range(n)) for mb in plan.microbatches for g in mb.groups)


@parametrize_names
def test_vpp_group_larger_than_the_sample_count_names_the_flag(name):
    scheduler = build_scheduler(name, **schedule_kwargs(microbatch_group_size_per_vp_stage=4))
    with pytest.raises(ValueError, match=VPP):
        scheduler.schedule([1, 2, 3])


# ------------------------------------------------------------------------------------------------
# Determinism across processes (no dict/set-order or hash dependence)
# ------------------------------------------------------------------------------------------------


def drawn(seed: int, count: int, low: int, high: int) -> tuple:
    rng = random.Random(seed)
    return tuple(rng.randint(low, high) for _ in range(count))


HASHSEED_CASES = [
    Case(2, 4, 64, 1, None, tuple([37] * 40 + [200, 255, 3, 1, 1, 1])),  # many ties
    Case(3, 1, 16, 1, 2, tuple(range(1, 17)) * 2),  # odd N, VPP
    Case(3, 4, 100, 4, None, drawn(5, 60, 1, 400)),  # min CP 4
    Case(1, 6, 30, 2, 3, tuple(random.Random(6).choices([1, 30, 179, 180], k=30))),  # N = 6
    Case(4, 2, 512, 1, None, drawn(7, 150, 1, 1024)),
]

_PLAN_DIGESTS = """
import hashlib, json, sys
from megatron_dcp.scheduling import build_scheduler
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


# ------------------------------------------------------------------------------------------------
# Regression tests: minimal reproducers of fixed scheduler bugs.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dp,min_cp,seqlens", [(3, 2, [0]), (7, 2, [0, 4, 4, 4, 4]), (10, 4, [0, 0, 0])]
)
def test_zero_length_sample_when_only_the_whole_domain_tiles(dp, min_cp, seqlens):
    """On a domain that min_cp_size cannot tile (N=3, min_cp=2) only the whole domain is
    allocatable; a sample whose cost does not drop on a larger group (length 0) must still be
    placed there (it used to crash with an AssertionError)."""
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=dp, cp_size=1, max_seqlen_per_dp_cp_rank=4, min_cp_size=min_cp
    )
    plan = scheduler.schedule(seqlens)
    assert check_plan(plan, tuple(seqlens), plan.domain, None) == []


def test_cost_model_with_large_cp_overhead_when_only_the_whole_domain_tiles():
    """Same root cause with a positive length: CP overhead makes the whole-domain group dearer
    per rank, yet it is the only group that can be allocated."""
    from megatron_dcp.scheduling import CostModel

    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=3,
        cp_size=1,
        max_seqlen_per_dp_cp_rank=4,
        min_cp_size=2,
        cost_model=CostModel(linear=1.0, quadratic=0.0, comm=10.0),
    )
    plan = scheduler.schedule([1])
    assert [[g.ranks for g in mb.groups] for mb in plan.microbatches] == [[(0, 1, 2)]]


@pytest.mark.parametrize(
    "dp,budget,min_cp,vpp,seqlens",
    [(3, 100, 1, 2, [150, 150, 150]), (11, 1024, 4, 4, [1, 1, 1, 1, 1])],
)
def test_vpp_feasible_input_gets_a_plan(dp, budget, min_cp, vpp, seqlens):
    """A plan exists although VPP caps the count below one sample per micro-batch: [150, 150,
    150] on N=3, budget 100, VPP 2: micro-batch 1 = sample 0 on ranks (0, 1); micro-batch 2 =
    samples 1, 2 on the whole domain (300 ≤ 3 × 100). It used to raise AssertionError."""
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=dp,
        cp_size=1,
        max_seqlen_per_dp_cp_rank=budget,
        min_cp_size=min_cp,
        microbatch_group_size_per_vp_stage=vpp,
    )
    plan = scheduler.schedule(seqlens)
    assert check_plan(plan, tuple(seqlens), plan.domain, vpp) == []


@pytest.mark.parametrize(
    "cp,budget,vpp,seqlens",
    [(1, 1, 2, [0, 0]), (8, 64, None, [31, 31] + [34] * 26 + [198, 234, 0, 0])],
    ids=["vpp", "no-vpp-n8"],
)
def test_default_dynamic_cp_zero_length_samples(cp, budget, vpp, seqlens):
    """Both inputs have plans (they used to crash: zero-cost samples all landed in one LPT bin).
    [0, 0] on one rank with VPP 2; and on N = 8 a plan of few micro-batches (3 suffice; it
    used to get 32 when [0, 0] was [1, 1])."""
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=1,
        cp_size=cp,
        max_seqlen_per_dp_cp_rank=budget,
        microbatch_group_size_per_vp_stage=vpp,
    )
    plan = scheduler.schedule(seqlens)
    assert check_plan(plan, tuple(seqlens), plan.domain, vpp) == []
    token_bound = -(-sum(seqlens) // (cp * budget))
    assert plan.num_microbatches <= max(vpp or 1, 2 * token_bound)  # not one per sample


@pytest.mark.parametrize(
    "dp,vpp,seqlens", [(2, None, [0, 0]), (2, 2, [0, 0, 0, 5]), (1, 2, [0, 0])]
)
def test_dp_balanced_accepts_zero_length_samples(dp, vpp, seqlens):
    """[0, 0] on 2 DP ranks: each rank takes one sample (zero-cost samples used to share one LPT
    bin, and dp_balanced raised "cannot fill 2 DP ranks")."""
    scheduler = build_scheduler(
        "dp_balanced",
        dp_size=dp,
        cp_size=1,
        max_seqlen_per_dp_cp_rank=8,
        microbatch_group_size_per_vp_stage=vpp,
    )
    plan = scheduler.schedule(seqlens)
    assert check_plan(plan, tuple(seqlens), plan.domain, vpp) == []


def test_vpp_infeasible_input_raises_a_value_error_naming_the_flag():
    """[2, 2, 2] with budget 2 on one rank needs 3 full micro-batches; VPP 2 allows 2 (too few)
    or 4 (one idle). No plan exists: a ValueError naming the VPP flag (not an AssertionError)."""
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=1,
        cp_size=1,
        max_seqlen_per_dp_cp_rank=2,
        microbatch_group_size_per_vp_stage=2,
    )
    with pytest.raises(ValueError, match=VPP):
        scheduler.schedule([2, 2, 2])


@pytest.mark.parametrize(
    "cp,budget,min_cp,seqlens",
    [(52, 2, 1, [1, 1, 2]), (50, 1897, 1, [1, 3, 6]), (46, 32, 2, [4, 1, 6, 1, 0])],
)
def test_blocks_freed_on_a_non_power_of_two_domain_leave_no_rank_idle(cp, budget, min_cp, seqlens):
    """Found by the fuzzer: a block given back to the allocator (a sample placed above the level
    of the last micro-batch, then taken back) was merged into an empty parent group."""
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=1,
        cp_size=cp,
        max_seqlen_per_dp_cp_rank=budget,
        min_cp_size=min_cp,
    )
    plan = scheduler.schedule(seqlens)
    assert check_plan(plan, tuple(seqlens), plan.domain, None) == []
    assert plan.num_microbatches == 1  # everything fits one micro-batch
