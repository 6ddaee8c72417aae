"""Topology-aware CP groups: the node layout of a domain, the two-tier cost (a group that spans
nodes pays the inter-node tier for its ring), the lower bound under it, the features and the
refinement that keep the layout, and plans that cross nodes only where it pays."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dcp.integration.node_layout import check_ranks_per_node, ranks_per_node
from megatron_dcp.scheduling import CostModel, Domain, build_scheduler
from megatron_dcp.scheduling.cost_fit import (
    OnlineRefinement,
    coefficients,
    predict,
    rank_features,
)
from megatron_dcp.scheduling.hardware import hardware_profile
from megatron_dcp.scheduling.metrics import critical_path, lower_bound, rank_loads
from megatron_dcp.scheduling.topology import (
    NodeLayout,
    contiguous_nodes,
    crossing_groups,
    intra_node_size,
    node_layout,
)
from megatron_dcp.tools.compare import DomainSpec

H100 = hardware_profile("h100-nvlink")
MODEL = CostModel.from_model_shape()


def layout_of(n: int, per_node: int, ranks=None) -> int:
    domain = Domain(n, 1, 1024)
    return intra_node_size(domain, contiguous_nodes(ranks or range(n), per_node))


def test_node_size_is_the_largest_group_inside_a_node():
    assert layout_of(64, 8) == 8
    assert layout_of(8, 8) == 8  # one node: nothing crosses
    assert layout_of(6, 8) == 6  # the whole (non-power-of-two) domain fits a node
    assert layout_of(64, 1) == 1
    # TP 2: positions are every other global rank, 4 of them per node of 8 GPUs.
    assert layout_of(32, 8, ranks=range(0, 64, 2)) == 4
    # Nodes of 6: the block [4, 8) of size 4 spans two nodes, so size 4 counts as crossing.
    assert layout_of(24, 6) == 2


def test_h100_tiers_and_cpu_without_a_second_tier():
    comm, ring = H100.inter_node_factors()
    assert comm == pytest.approx(9.0) and ring > 1
    assert hardware_profile("cpu-gloo").inter_node_factors() == (1.0, 1.0)
    with pytest.raises(ValueError, match="never faster"):
        NodeLayout(8, comm_factor=0.5)


def test_a_group_that_spans_nodes_pays_the_inter_node_tier():
    cost = CostModel(1.0, 0.001, comm=0.1, ring_step=5.0, nodes=NodeLayout(8, 9.0, 2.0))
    flat = cost.with_nodes(None)
    assert cost.group_cost([1000], 8) == pytest.approx(flat.group_cost([1000], 8))
    extra_comm = 0.1 * 8.0 * 1000 * 15 / 16
    extra_ring = 5.0 * 15
    expected = flat.group_cost([1000], 16) + extra_comm + extra_ring
    assert cost.group_cost([1000], 16) == pytest.approx(expected)
    assert not cost.crosses_nodes(8) and cost.crosses_nodes(16)


@settings(deadline=None, max_examples=40)
@given(
    lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=80),
    per_node=st.sampled_from([1, 2, 4, 8]),
    comm=st.floats(1.0, 20.0),
    ring=st.floats(1.0, 5.0),
    dev_peer=st.booleans(),
)
def test_the_bound_stays_a_lower_bound_over_nodes(lengths, per_node, comm, ring, dev_peer):
    from megatron_dcp.tools.peers.megatron_dev_greedy import DevGreedyPeer

    layout = NodeLayout(per_node, comm, ring)
    cost = replace(MODEL, ring_step=64 * MODEL.linear, comm=0.03 * MODEL.linear, nodes=layout)
    kwargs = dict(dp_size=4, cp_size=4, max_seqlen_per_dp_cp_rank=4096, cost_model=cost)
    scheduler = (
        DevGreedyPeer(**kwargs) if dev_peer else build_scheduler("default_dynamic_cp", **kwargs)
    )
    plan = scheduler.schedule(lengths)
    assert critical_path(plan, cost) >= lower_bound(plan, cost) * (1 - 1e-9)


def test_features_and_refinement_keep_the_layout():
    cost = replace(MODEL, ring_step=1e-3, comm=1e-6, nodes=NodeLayout(2, 9.0, 3.0))
    plan = build_scheduler(
        "default_dynamic_cp", dp_size=8, cp_size=1, max_seqlen_per_dp_cp_rank=2048, cost_model=cost
    ).schedule([16000, 9000, 3000, 1200, 800, 500] * 3)
    assert crossing_groups(plan, cost.nodes) > 0
    theta = coefficients(cost)
    predicted = [predict(theta, row) for row in rank_features(plan, cost.nodes)]
    measured = [sum(rank_loads(plan, mb, cost)[p] for mb in plan.microbatches) for p in range(8)]
    microbatches = cost.microbatch * plan.num_microbatches
    assert predicted == pytest.approx([m + microbatches for m in measured])
    assert OnlineRefinement(cost).cost.nodes == cost.nodes


def test_two_tiers_never_plan_worse_than_one_on_the_reference_workloads():
    from megatron_dcp.tools.benchmark_matrix import matrix_lengths
    from megatron_dcp.tools.topology_table import tier_row
    from megatron_dcp.tools.workloads import reference_workload

    workload = reference_workload("uniform")
    cost = replace(MODEL, name="latency", comm=0.03 * MODEL.linear, ring_step=64 * MODEL.linear)
    for budget in (2048, 4096):
        spec = DomainSpec(workload.dp_size, workload.cp_size, budget, ranks_per_node=8)
        row = tier_row("uniform", matrix_lengths(workload, budget, 0), spec, cost)
        assert row.two_tier[0] <= row.one_tier[0] * (1 + 1e-9)
        assert row.two_tier[1] <= row.one_tier[1]


@settings(deadline=None, max_examples=25)
@given(
    lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=60),
    per_node=st.sampled_from([2, 4, 8]),
    vpp=st.sampled_from([None, 2]),
)
def test_knowing_the_nodes_never_plans_a_longer_critical_path(lengths, per_node, vpp):
    """The plan made blind to the nodes competes, priced over them: whatever the lengths."""
    layout = NodeLayout(per_node, 9.0, 2.3)
    cost = replace(MODEL, ring_step=64 * MODEL.linear, comm=0.03 * MODEL.linear, nodes=layout)
    kwargs = dict(dp_size=4, cp_size=4, max_seqlen_per_dp_cp_rank=4096)
    kwargs["microbatch_group_size_per_vp_stage"] = vpp
    try:
        aware = build_scheduler("default_dynamic_cp", cost_model=cost, **kwargs).schedule(lengths)
    except ValueError:
        return  # VPP: more micro-batches than samples allow
    flat = cost.with_nodes(None)
    blind = build_scheduler("default_dynamic_cp", cost_model=flat, **kwargs).schedule(lengths)
    assert critical_path(aware, cost) <= critical_path(blind, cost) * (1 + 1e-9)


def test_ranks_per_node_from_the_flag_or_the_launcher():
    assert ranks_per_node(4, {"LOCAL_WORLD_SIZE": "8"}) == 4
    assert ranks_per_node(None, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert ranks_per_node(None, {"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert ranks_per_node(None, {"SLURM_NTASKS_PER_NODE": "4(x2)"}) is None
    assert ranks_per_node(None, {}) is None
    with pytest.raises(ValueError, match="--dcp-ranks-per-node=0"):
        ranks_per_node(0)
    with pytest.raises(ValueError, match="--dcp-ranks-per-node=3: the world size 8"):
        check_ranks_per_node(3, 8)


def test_the_training_layout_follows_global_ranks():
    domain = Domain(8, 1, 1024)
    layout = node_layout(domain, list(range(0, 16, 2)), 4, H100)
    assert layout.node_size == 2 and layout.comm_factor == pytest.approx(9.0)
    assert node_layout(domain, list(range(8)), None, H100) is None
    assert node_layout(domain, list(range(8)), 4, hardware_profile("cpu-gloo")).comm_factor == 1.0


def test_the_training_scheduler_prices_its_domain_over_the_nodes():
    from megatron_dcp.integration.config import DCPConfig

    config = DCPConfig(2048, cp_size=2, ranks_per_node=4, hardware="h100-nvlink")
    scheduler = config.build_scheduler(8, domain_ranks=list(range(8, 16)))
    assert scheduler.cost_model.nodes == NodeLayout(4, *H100.inter_node_factors())
    assert config.build_scheduler(8).cost_model.nodes is None
    with pytest.raises(ValueError, match="--dcp-ranks-per-node=-1"):
        DCPConfig(2048, ranks_per_node=-1)
