"""Property tests and explicit examples of scheduler edge cases: empty input, one huge sequence,
lengths 0 and 1, fewer samples than ranks, minimum CP sizes that cannot tile the domain, VPP
limits. The regression tests at the end pin fixed scheduler bugs (zero-length samples, domains
that only the whole-domain group tiles, VPP edge cases).
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import (
    BUDGET,
    NAMES,
    VPP,
    is_pow2,
    layouts,
    lengths,
    parametrize_names,
    plan_or_none,
    scaled,
    schedule_kwargs,
)

from megatron_dcp.scheduling import build_scheduler
from megatron_dcp.tools.fuzz_cases import FuzzCase
from megatron_dcp.tools.plan_check import check_plan

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
    case = FuzzCase(dp, cp, budget, min_cp, vpp, tuple(seqlens))
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
    case = FuzzCase(dp, cp, budget, min_cp, None, tuple(seqlens))
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
