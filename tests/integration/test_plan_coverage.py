"""The coverage helper of the oracle tests (``testing.plan_coverage``) and the switch that checks
it (``testing.force_static_plan``): the messages name the missing coverage; a training log gives
its layout and plans; the switch makes DCP plan one CP size (static CP where static CP can run
the batch) on every path that builds a scheduler by name. (Integration layer: importing
``megatron_dcp.testing`` imports torch.)"""

import pytest

from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.scheduling import SCHEDULERS, build_scheduler
from megatron_dcp.scheduling.dynamic_cp.scheduler import DefaultDynamicCPScheduler
from megatron_dcp.testing.force_static_plan import (
    SWITCH,
    StaticPlanScheduler,
    force_static_plans,
    launch_entry,
)
from megatron_dcp.testing.plan_coverage import (
    Layout,
    RanPlan,
    assert_covers,
    plan_of,
    training_run_plan,
)
from megatron_dcp.tools.launching.training_runs import parse_log

DP2CP2 = Layout(dp=2, cp=2)
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)


def failure(*args, **kwargs) -> str:
    with pytest.raises(AssertionError) as error:
        assert_covers(*args, **kwargs)
    return str(error.value)


def test_a_static_plan_fails_a_mix_claim_and_says_so():
    message = failure(RanPlan((2,), 3, DP2CP2), DP2CP2, mix_of={1, 2, 4})
    assert message == (
        "test ran CP sizes {2} only; it covers a mix of CP sizes {1, 2, 4}: "
        "the planner returned a static plan"
    )
    message = failure(RanPlan((4,), 3, DP2CP2), DP2CP2)
    assert message.endswith("it covers a mix of CP sizes: the planner returned a single-size plan")


def test_a_mix_missing_a_claimed_size_names_it():
    message = failure(RanPlan((1, 2), 3, DP2CP2), DP2CP2, mix_of={4})
    assert message == "test ran CP sizes {1, 2}; it covers a mix of CP sizes {4}: {4} missing"
    assert_covers(RanPlan((1, 2, 4), 3, DP2CP2), DP2CP2, mix_of={4})


def test_ranks_views_are_joined_and_runs_need_one_mixed_plan():
    """Each rank may see only its own groups (the RL adapter, verl): their sizes are joined per
    plan. A run of several global batches needs one plan that mixes, not sizes spread over
    single-size plans."""
    assert_covers([RanPlan((1, 1), 2, DP2CP2), RanPlan((2, 2), 2, DP2CP2)], DP2CP2)
    run = RanPlan(((2,), (4,), (4,)), (1, 2, 2), DP2CP2)
    assert failure(run, DP2CP2) == (
        "test ran one CP size per plan ({2}, {4}, {4}); it covers a mix of CP sizes: the planner "
        "returned single-size plans"
    )
    assert_covers(RanPlan(((2,), (1, 4)), (1, 2), DP2CP2), DP2CP2, num_microbatches=(1, 2))


def test_exact_claims_layouts_and_micro_batch_counts():
    message = failure(RanPlan((1, 2), 3, DP2CP2), DP2CP2, cp_sizes={2})
    assert message == "test ran CP sizes {1, 2}; it covers static CP {2} only: {1} not claimed"
    message = failure(RanPlan((1, 2), 3, DP2CP2), DP2CP2, cp_sizes={4})
    assert message.endswith("covers CP size {4} only: {4} missing, {1, 2} not claimed")
    message = failure(RanPlan((1, 2), 3, Layout(dp=4)), DP2CP2)
    assert message == "test ran layout tp1·pp1·dp4·cp1; it covers tp1·pp1·dp2·cp2"
    assert failure(RanPlan((1, 2), 3, DP2CP2), DP2CP2, num_microbatches=4) == (
        "test ran 3 micro-batches; it covers 4"
    )
    assert failure(RanPlan((1, 2), 3, DP2CP2), DP2CP2, min_microbatches=5) == (
        "test ran 3 micro-batches; it covers 5 or more"
    )


TRAINING_LOG = """
------------------------ arguments ------------------------
  context_parallel_size ........................... 2
  data_parallel_size .............................. 2
  pipeline_model_parallel_size .................... 2
  tensor_model_parallel_size ...................... 1
  virtual_pipeline_model_parallel_size ............ 2
-------------------- end of arguments ---------------------
[rank0]: [DCP] iteration        1 | micro-batches: 4 | CP sizes (size:seqs): 1:9 2:5 4:2 | plan \
time (ms): 3.1 | load imbalance est./meas.: 1.100/1.200 | fwd-bwd time (ms) pred./meas.: 5.0/6.0 | \
tokens/s: 900
[rank0]: [DCP] iteration        2 | micro-batches: 2 | CP sizes (size:seqs): 2:16 | plan \
time (ms): 3.1 | load imbalance est./meas.: 1.100/1.200 | fwd-bwd time (ms) pred./meas.: 5.0/6.0 | \
tokens/s: 900
""".replace("\\\n", "")


def test_a_training_log_gives_its_layout_and_plans():
    ran = training_run_plan(parse_log(TRAINING_LOG))
    assert ran == RanPlan(((1, 2, 4), (2,)), (4, 2), Layout(pp=2, vpp=2, dp=2, cp=2))
    assert_covers(ran, Layout(pp=2, vpp=2, dp=2, cp=2), mix_of={4}, num_microbatches=(4, 2))
    with pytest.raises(AssertionError, match="prints no virtual_pipeline_model_parallel_size"):
        training_run_plan(parse_log(TRAINING_LOG.replace("virtual_", "")))


def test_the_switch_plans_static_cp_where_it_can_and_one_size_elsewhere(monkeypatch):
    monkeypatch.setitem(SCHEDULERS, DefaultDynamicCPScheduler.name, DefaultDynamicCPScheduler)
    config = DCPConfig(max_seqlen_per_dp_cp_rank=100, cp_size=2)
    dynamic = plan_of(config.build_scheduler(4).schedule(LENGTHS), DP2CP2)
    force_static_plans()
    assert SCHEDULERS["default_dynamic_cp"] is StaticPlanScheduler
    static = plan_of(config.build_scheduler(4).schedule(LENGTHS), DP2CP2)
    assert failure(static, DP2CP2).endswith("the planner returned a static plan")
    assert len(dynamic.cp_sizes) > 1  # what the switch takes away
    # 200 tokens do not fit static CP 2 at budget 64: one size that holds them, 4.
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=64
    )
    assert scheduler.schedule(LENGTHS).cp_size_histogram() == {4: len(LENGTHS)}


def test_torchrun_jobs_go_through_the_switch_only_when_it_is_on(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    assert launch_entry("pretrain_gpt", ["--x"]) == ("pretrain_gpt", ["--x"])
    monkeypatch.setenv(SWITCH, "1")
    assert launch_entry("pretrain_mamba", ["--x"]) == (
        "testing.force_static_plan",
        ["pretrain_mamba", "--x"],
    )
