"""DCP never plans a longer critical path than static CP: the static plan at the configured CP
size is one of its candidates, priced by the same cost model."""

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dcp.scheduling import CostModel, build_scheduler
from megatron_dcp.scheduling.metrics import critical_path

# Worlds from compute-bound to overhead-bound: a fixed cost per micro-batch that dwarfs the
# attention makes fewer, larger CP groups (static CP's) the faster plan.
COSTS = st.builds(
    CostModel,
    linear=st.sampled_from([1e-6, 1e-5]),
    quadratic=st.sampled_from([0.0, 1e-9, 1e-8]),
    comm=st.sampled_from([0.0, 1e-7]),
    ring_step=st.sampled_from([0.0, 1e-4]),
    cp_efficiency=st.sampled_from([1.0, 0.9]),
    microbatch=st.sampled_from([0.0, 1e-3, 5e-2]),
)


@settings(max_examples=150)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=4, max_size=48),
    dp=st.sampled_from([1, 2]),
    cp=st.sampled_from([2, 4]),
    vpp=st.sampled_from([None, 2]),
    cost=COSTS,
)
def test_dcp_is_never_predicted_slower_than_static_cp(lengths, dp, cp, vpp, cost):
    kwargs = dict(
        dp_size=dp,
        cp_size=cp,
        max_seqlen_per_dp_cp_rank=2048,
        microbatch_group_size_per_vp_stage=vpp,
        cost_model=cost,
    )
    try:
        static = build_scheduler("dp_balanced", **kwargs).schedule(lengths)
    except ValueError:
        return  # static CP cannot run this batch (too few samples for its bins)
    dcp = build_scheduler("default_dynamic_cp", **kwargs).schedule(lengths)
    assert critical_path(dcp, cost) <= critical_path(static, cost) * (1 + 1e-12)


def test_static_cp_wins_where_micro_batches_are_expensive():
    """A fixed cost per micro-batch far above the attention's: the static plan (fewer
    micro-batches, whole sequences on CP 2) is what DCP returns."""
    cost = CostModel(linear=1e-6, quadratic=0.0, microbatch=1.0)
    lengths = [900, 700, 500, 300, 1000, 800, 600, 400]
    kwargs = dict(dp_size=1, cp_size=2, max_seqlen_per_dp_cp_rank=1024, cost_model=cost)
    static = build_scheduler("dp_balanced", **kwargs).schedule(lengths)
    dcp = build_scheduler("default_dynamic_cp", **kwargs).schedule(lengths)
    assert critical_path(dcp, cost) <= critical_path(static, cost)
