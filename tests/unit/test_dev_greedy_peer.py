"""The Megatron-dev greedy peer of the simulator: its plans are valid (every invariant, checked
by ``Plan.validate`` and the independent checker) and follow the published algorithm."""

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


def test_smallest_cp_size_on_the_first_block_with_room():
    plan = peer(4).schedule([150, 90, 80, 10])
    assert groups(plan) == [[((0, 1), (0,)), ((2,), (1, 3)), ((3,), (2,))]]


def test_empty_ranks_are_filled_by_doubling_the_neighbouring_group():
    assert groups(peer(4).schedule([100])) == [[((0, 1, 2, 3), (0,))]]
    plan = peer(4).schedule([100, 100, 100])
    assert groups(plan) == [[((0,), (0,)), ((1,), (1,)), ((2, 3), (2,))]]


def test_vpp_splits_the_fullest_micro_batch():
    plan = peer(2, vpp=2).schedule([50, 50, 50])
    assert plan.num_microbatches == 2
    assert sorted(len(mb.groups) for mb in plan.microbatches) == [1, 1]


def test_a_domain_that_is_no_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        peer(6)


@settings(max_examples=150, deadline=None)
@given(
    log_n=st.integers(0, 5),
    budget=st.integers(8, 300),
    vpp=st.sampled_from([None, 2, 3, 4]),
    data=st.data(),
)
def test_plans_pass_every_invariant(log_n, budget, vpp, data):
    n = 2**log_n
    seqlens = data.draw(st.lists(st.integers(0, n * budget), min_size=1, max_size=40))
    scheduler = peer(n, budget, vpp)
    try:
        plan = scheduler.schedule(seqlens)
    except ValueError as error:
        assert vpp and "multiple" in str(error)  # too few sequences to split for VPP
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
