"""Fast end-to-end checks of both schedulers on the reference-like workloads."""

import random

import pytest

from megatron_dcp.scheduling import CostModel, build_scheduler
from megatron_dcp.scheduling.metrics import critical_path, lower_bound

LAYOUTS = [(2, 4, 2048), (1, 1, 512), (3, 2, 1024), (4, 4, 4096)]


def lengths(seed: int, count: int, high: int):
    rng = random.Random(seed)
    return [max(1, int(rng.lognormvariate(6.0, 1.2))) % high + 1 for _ in range(count)]


@pytest.mark.parametrize("dp,cp,budget", LAYOUTS)
@pytest.mark.parametrize("name", ["default_dynamic_cp", "dp_balanced"])
def test_plan_is_valid_and_deterministic(name, dp, cp, budget):
    seqlens = lengths(dp * cp, 40 * dp, cp * budget)
    scheduler = build_scheduler(name, dp_size=dp, cp_size=cp, max_seqlen_per_dp_cp_rank=budget)
    plan = scheduler.schedule(seqlens)
    assert plan.validate() is plan
    assert sorted(i for mb in plan.microbatches for i in mb.sample_ids) == list(range(len(seqlens)))
    assert plan == scheduler.schedule(list(seqlens))


@pytest.mark.parametrize("cost", [CostModel.from_model_shape(), CostModel.attention_only()])
def test_dynamic_cp_is_close_to_the_lower_bound(cost):
    seqlens = lengths(1, 300, 8192)
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=2, cp_size=4, max_seqlen_per_dp_cp_rank=2048, cost_model=cost
    )
    plan = scheduler.schedule(seqlens)
    assert critical_path(plan, cost) <= 1.05 * lower_bound(plan, cost)


def test_empty_input_gives_an_empty_plan():
    plan = build_scheduler(
        "default_dynamic_cp", dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8
    ).schedule([])
    assert plan.microbatches == ()


def test_fewer_samples_than_ranks_leaves_no_rank_idle():
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=4, cp_size=2, max_seqlen_per_dp_cp_rank=64
    )
    plan = scheduler.schedule([100, 3, 7])
    assert plan.num_microbatches == 1
    assert all(g.sample_ids for g in plan.microbatches[0].groups)
    assert sum(g.size for g in plan.microbatches[0].groups) == 8


def test_vpp_alignment():
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=2,
        cp_size=2,
        max_seqlen_per_dp_cp_rank=256,
        microbatch_group_size_per_vp_stage=3,
    )
    assert scheduler.schedule(lengths(3, 50, 1024)).num_microbatches % 3 == 0


@pytest.mark.parametrize(
    "kwargs,seqlens,flag",
    [
        (dict(max_seqlen_per_dp_cp_rank=0), [1], "budget=0"),
        (dict(max_seqlen_per_dp_cp_rank=8, min_cp_size=3), [1], "min_cp_size=3"),
        (dict(max_seqlen_per_dp_cp_rank=8), [33], "budget=8"),
        (dict(max_seqlen_per_dp_cp_rank=8), [-1], "seqlens[0]"),
    ],
)
def test_bad_input_names_the_parameter(kwargs, seqlens, flag):
    with pytest.raises(ValueError, match=flag.replace("[", r"\[").replace("]", r"\]")):
        build_scheduler("default_dynamic_cp", dp_size=2, cp_size=2, **kwargs).schedule(seqlens)
