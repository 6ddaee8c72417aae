"""The Megatron-dev greedy peer of the simulator: its plans are valid (every invariant, checked
by ``Plan.validate`` and the independent checker) and follow upstream's
``DefaultDynamicCPScheduler`` (Megatron-LM dev, ``megatron/core/datasets/data_schedule*.py``)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dcp.tools.compare import DEV_PEER_ALIAS, DomainSpec, run_scheduler
from megatron_dcp.tools.peers.megatron_dev_greedy import DevGreedyPeer
from megatron_dcp.tools.plan_check import check_plan


def peer(n: int, budget: int = 100, vpp=None, min_cp: int = 1) -> DevGreedyPeer:
    return DevGreedyPeer(
        dp_size=n,
        cp_size=1,
        max_seqlen_per_dp_cp_rank=budget,
        min_cp_size=min_cp,
        microbatch_group_size_per_vp_stage=vpp,
    )


def groups(plan):
    return [[(g.ranks, g.sample_ids) for g in mb.groups] for mb in plan.microbatches]


def test_smallest_cp_size_in_the_first_group_with_room_when_the_peak_is_unchanged():
    # 10 could join [2] (90) or [3] (80) without raising the peak workload: the first one wins.
    plan = peer(4).schedule([150, 90, 80, 10])
    assert groups(plan) == [[((0, 1), (0,)), ((2,), (1, 3)), ((3,), (2,))]]


def test_a_larger_cp_size_is_taken_when_it_lowers_the_peak_workload():
    # 100 alone on one rank (100² = 10000) would beat 101 on two (101²/2): it takes two ranks.
    assert groups(peer(4).schedule([101, 100])) == [[((0, 1), (0,)), ((2, 3), (1,))]]


def test_a_sequence_joins_the_group_that_keeps_the_peak_lowest():
    # 30 fits both groups of two; joining 100's (5000 + 450) keeps the peak below joining 101's.
    plan = peer(4).schedule([101, 100, 30])
    assert groups(plan) == [[((0, 1), (0,)), ((2, 3), (1, 2))]]


def test_empty_ranks_double_the_leftmost_smallest_group():
    assert groups(peer(4).schedule([100])) == [[((0, 1, 2, 3), (0,))]]
    plan = peer(4).schedule([100, 100, 100])
    assert groups(plan) == [[((0, 1), (0,)), ((2,), (1,)), ((3,), (2,))]]


def test_filling_empty_ranks_never_merges_groups():
    plan = peer(4).schedule([100, 50, 40, 10])
    assert groups(plan) == [[((0, 1), (0,)), ((2, 3), (1, 2, 3))]]
    plan = peer(8).schedule([101, 100])
    assert groups(plan) == [[((0, 1, 2, 3), (0,)), ((4, 5, 6, 7), (1,))]]


def test_vpp_splits_the_last_micro_batch_at_a_group_boundary():
    # Three micro-batches, the middle one the fullest: the last one is split, its right half
    # keeps its place and its left half is appended, each refilled by doubling.
    plan = peer(2, vpp=2).schedule([100, 100, 60, 50, 40, 30, 100])
    assert groups(plan) == [
        [((0,), (0,)), ((1,), (1,))],
        [((0,), (6,)), ((1,), (2, 4))],
        [((0, 1), (5,))],
        [((0, 1), (3,))],
    ]


def test_vpp_cuts_at_the_middle_rank_and_refills_each_half():
    plan = peer(4, vpp=2).schedule([200, 100, 100])
    assert groups(plan) == [[((0, 1), (1,)), ((2, 3), (2,))], [((0, 1, 2, 3), (0,))]]


def test_vpp_never_splits_a_micro_batch_of_one_group():
    with pytest.raises(ValueError, match="multiple of 2"):
        peer(1, vpp=2).schedule([10, 20, 30])


def test_a_domain_that_is_no_power_of_two_falls_back_to_the_whole_domain():
    # [4, 2] leaves rank 6 empty and the group of two cannot grow: one group of all 7 ranks.
    assert groups(peer(7).schedule([400, 200])) == [[(tuple(range(7)), (0, 1))]]
    plan = peer(6).schedule([100] * 5)
    assert groups(plan)[0][0] == ((0, 1), (0,))


def test_where_upstream_fails_the_peer_has_no_plan():
    with pytest.raises(ValueError, match="upstream"):
        peer(5).schedule([200, 200])  # the push would run past the last rank
    with pytest.raises(ValueError, match="upstream"):
        peer(6).schedule([500])  # CP size 8 on 6 ranks


@settings(max_examples=150, deadline=None)
@given(
    n=st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32]), st.integers(1, 12)),
    budget=st.integers(8, 300),
    vpp=st.sampled_from([None, 2, 3, 4]),
    data=st.data(),
)
def test_plans_pass_every_invariant(n, budget, vpp, data):
    seqlens = data.draw(st.lists(st.integers(0, n * budget), min_size=1, max_size=40))
    scheduler = peer(n, budget, vpp)
    try:
        plan = scheduler.schedule(seqlens)
    except ValueError as error:
        assert "upstream" in str(error)
        if n & (n - 1) == 0:  # on a power of two only a VPP count can fail
            assert vpp and "multiple" in str(error)
        return
    assert check_plan(plan, seqlens, scheduler.domain, vpp) == []
    for mb in plan.microbatches:
        for group in mb.groups:
            assert all(
                scheduler.domain.cp_degree(seqlens[i]) <= group.size for i in group.sample_ids
            )


def test_the_simulator_runs_it_beside_ours():
    result = run_scheduler(DEV_PEER_ALIAS, [300, 20, 20, 700], DomainSpec(4, 2, 128), _model())
    assert result.report is not None and result.report.num_microbatches >= 1


def _model():
    from megatron_dcp.scheduling import CostModel

    return CostModel.from_model_shape()
