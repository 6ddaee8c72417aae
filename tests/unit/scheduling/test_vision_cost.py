"""Vision work (a VLM sample's encoder patches, ``CostModel.vision``): its exact price in
``group_cost``, the patches through ``Scheduler.schedule`` and ``Plan``, zero-vision plans equal
to text plans (property), the lower bound below every plan with patches (property), and a case
where the DCP plan changes because of them."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import cases, cost_models, parametrize_names, plan_or_none, scaled

from megatron_dcp.scheduling import CostModel, InvalidPlanError, build_scheduler
from megatron_dcp.scheduling.cost import cost_keys
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.lower_bound import batch_lower_bound, static_cp_lower_bound
from megatron_dcp.scheduling.metrics import critical_path, lower_bound, plan_imbalance, rank_loads

RING = CostModel(1.0, 0.001, comm=0.1, ring_step=30.0, cp_efficiency=0.9, vision=0.25)


def test_group_cost_adds_each_samples_vision_share_exactly():
    lengths, patches, c = [100, 200, 7], [8, 0, 1000], 4
    expected = RING.per_rank(100, c) + 0.25 * 8 / c
    expected += RING.per_rank(200, c)
    expected += RING.per_rank(7, c) + 0.25 * 1000 / c
    assert RING.group_cost(lengths, c, patches) == expected + RING.ring_cost(c)
    assert RING.group_cost(lengths, c, [0, 0, 0]) == RING.group_cost(lengths, c)
    assert RING.group_cost([], c, []) == 0.0
    blind = replace(RING, vision=0.0)
    assert blind.group_cost(lengths, c, patches) == blind.group_cost(lengths, c)
    # Without a vision coefficient samples are priced (and planned) by their lengths alone.
    assert cost_keys(lengths, patches, blind) is lengths
    assert cost_keys(lengths, patches, RING) == ((100, 8), 200, (7, 1000))


def test_vision_is_validated_like_the_other_coefficients():
    with pytest.raises(ValueError, match="≥ 0"):
        CostModel(1.0, 0.0, vision=-1e-9)
    assert CostModel(1.0, 0.0).vision == 0.0


def test_schedule_refuses_bad_patches_naming_them():
    scheduler = build_scheduler("default_dynamic_cp", dp_size=2, cp_size=1,
                                max_seqlen_per_dp_cp_rank=64)  # fmt: skip
    for bad in ([1], [1, 2, 3], [1, -1], [True, 0], [1.5, 0]):
        with pytest.raises(SchedulingError, match=r"patches"):
            scheduler.schedule([10, 20], bad)
    assert scheduler.schedule([10, 20], [0, 0]).patches == ()  # all 0: none
    assert scheduler.schedule([10, 20], (3, 0)).patches == (3, 0)


def test_validate_refuses_patches_of_another_length():
    plan = build_scheduler("dp_balanced", dp_size=1, cp_size=1,
                           max_seqlen_per_dp_cp_rank=64).schedule([3, 4, 5], [1, 0, 2])  # fmt: skip
    with pytest.raises(InvalidPlanError, match="patches holds 2 counts for 3 samples"):
        replace(plan, patches=(1, 0)).validate()
    with pytest.raises(InvalidPlanError, match="non-negative"):
        replace(plan, patches=(1, 0, -2)).validate()


def test_digest_includes_patches_only_when_there_are_some():
    scheduler = build_scheduler("default_dynamic_cp", dp_size=2, cp_size=2,
                                max_seqlen_per_dp_cp_rank=64, cost_model=RING)  # fmt: skip
    text = scheduler.schedule([30, 20, 90, 5])
    assert scheduler.schedule([30, 20, 90, 5], [0, 0, 0, 0]).digest() == text.digest()
    nine = replace(text, patches=(0, 0, 9, 0)).digest()
    assert nine != text.digest() and nine != replace(text, patches=(0, 0, 8, 0)).digest()


def _equal_lengths_case(name):
    """Six samples of 50 tokens on two ranks (budget 150: one micro-batch of three per rank);
    samples 0 and 2 carry many patches. Blind, LPT deals ids 0, 2, 4 to one rank."""
    cost = CostModel(1.0, 0.0, ring_step=1000.0, vision=1.0)
    scheduler = build_scheduler(name, dp_size=2, cp_size=1, max_seqlen_per_dp_cp_rank=150,
                                cost_model=cost)  # fmt: skip
    lengths, patches = [50] * 6, [400, 0, 400, 0, 0, 0]
    return scheduler, cost, lengths, patches


@parametrize_names
def test_patches_change_the_plan_and_shorten_its_critical_path(name):
    scheduler, cost, lengths, patches = _equal_lengths_case(name)
    aware = scheduler.schedule(lengths, patches)
    blind = replace(scheduler.schedule(lengths), patches=tuple(patches))
    assert critical_path(aware, cost) < critical_path(blind, cost)
    for microbatch in aware.microbatches:  # the two image samples on different ranks
        assert [set(g.sample_ids) >= {0, 2} for g in microbatch.groups] == [False, False]
    assert critical_path(aware, cost) == 3 * 50 + 400  # the best: one image sample per rank


def _patches(data, count):
    """Random encoder patches for ``count`` samples: none, a few, or many per sample."""
    one = st.one_of(st.just(0), st.integers(1, 8), st.integers(0, 5000))
    return data.draw(st.lists(one, min_size=count, max_size=count))


@parametrize_names
@settings(max_examples=scaled(60), deadline=None)
@given(data=st.data(), cost=cost_models())
def test_plans_without_vision_work_are_the_text_plans(name, data, cost):
    """vision = 0 (any patches) or all patches 0 (any vision): the plan, its critical path,
    bound and loads are the text plan's, bit for bit."""
    case = data.draw(cases(name))
    text = plan_or_none(name, case)
    if text is None or not case.seqlens:
        return
    patches = _patches(data, len(case.seqlens))
    scheduler = build_scheduler(name, **{**case.kwargs(), "cost_model": cost})
    text = scheduler.schedule(case.seqlens)
    blind = scheduler.schedule(case.seqlens, patches)
    assert blind.microbatches == text.microbatches
    assert critical_path(blind, cost) == critical_path(text, cost)
    assert lower_bound(blind, cost) == lower_bound(text, cost)
    assert plan_imbalance(blind, cost) == plan_imbalance(text, cost)
    seeing = replace(cost, vision=data.draw(st.floats(0.001, 10.0)))
    scheduler = build_scheduler(name, **{**case.kwargs(), "cost_model": seeing})
    zero = scheduler.schedule(case.seqlens, [0] * len(case.seqlens))
    assert zero == scheduler.schedule(case.seqlens)


@parametrize_names
@settings(max_examples=scaled(100), deadline=None)
@given(data=st.data(), cost=cost_models(spill=True, nodes=True), vision=st.floats(0.0, 50.0))
def test_the_lower_bound_is_below_every_plan_with_patches(name, data, cost, vision):
    """Random patches and vision coefficient: the bound (vision work included) stays below the
    critical path of the plan made with the patches, and of the plan made blind to them; static
    CP's own bound stays below dp_balanced's plan."""
    case = data.draw(cases(name))
    if plan_or_none(name, case) is None or not case.seqlens:
        return
    cost = replace(cost, vision=vision)
    patches = _patches(data, len(case.seqlens))
    scheduler = build_scheduler(name, **{**case.kwargs(), "cost_model": cost})
    try:
        aware = scheduler.schedule(case.seqlens, patches)
    except SchedulingError:
        return  # the sample cap or VPP may refuse what the text plan took: not this test's
    blind = replace(scheduler.schedule(case.seqlens), patches=aware.patches)
    for plan in (aware, blind):
        assert lower_bound(plan, cost) <= critical_path(plan, cost) * (1 + 1e-9)
        rows = [rank_loads(plan, mb, cost) for mb in plan.microbatches]
        assert sum(map(max, rows)) + cost.microbatch * len(rows) == pytest.approx(
            critical_path(plan, cost), rel=1e-12
        )
    if name == "dp_balanced":
        bound = static_cp_lower_bound(
            aware.seqlens, aware.domain, cost, case.vpp, aware.patches
        )
        assert bound <= critical_path(aware, cost) * (1 + 1e-9)


def test_the_bound_counts_vision_work_over_the_domain():
    cost = CostModel(1.0, 0.0, vision=2.0)
    scheduler = build_scheduler("dp_balanced", dp_size=4, cp_size=1,
                                max_seqlen_per_dp_cp_rank=100, cost_model=cost)  # fmt: skip
    plan = scheduler.schedule([10, 10, 10, 10])
    text = batch_lower_bound(plan.seqlens, plan.domain, cost)
    with_patches = batch_lower_bound(plan.seqlens, plan.domain, cost, None, [4, 0, 0, 0])
    assert with_patches == pytest.approx(text + 2.0 * 4 / 4)


def test_vision_work_can_fill_the_half_an_unpaired_sample_leaves():
    """One half-domain sample (190 tokens, CP 2 of N = 4) and two short samples whose vision
    work fills the other half exactly: the plan is perfectly balanced, so the bound may charge
    no idle time (the text-only charge would put it above the plan)."""
    cost = CostModel(1.0, 0.0, comm=1.0, vision=1.0)  # the whole domain costs it 380 more
    scheduler = build_scheduler("default_dynamic_cp", dp_size=4, cp_size=1,
                                max_seqlen_per_dp_cp_rank=100, cost_model=cost)  # fmt: skip
    plan = scheduler.schedule([190, 1, 1], [0, 189, 189])
    assert critical_path(plan, cost) == 190.0  # 95 of work and 95 of K/V exchange per rank
    assert lower_bound(plan, cost) == pytest.approx(190.0)
