"""Unit tests of the scheduler front door: bad input raises ValueErrors that name the parameter,
and the registry builds, registers and guards schedulers. Pure Python, no hypothesis."""

import gc

import pytest

from megatron_dcp.scheduling import (
    SCHEDULERS,
    CPGroup,
    InvalidPlanError,
    MicroBatch,
    Scheduler,
    build_scheduler,
)
from megatron_dcp.tools.plan_check import check_plan

NAMES = ("default_dynamic_cp", "dp_balanced")
# Scheduling errors name the scheduling parameters (the flags come from the layers above).
BUDGET, MIN_CP, VPP = "budget", "min_cp_size", "microbatch_group_size_per_vp_stage"


# ------------------------------------------------------------------------------------------------
# Bad input: ValueErrors that name the flag
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("budget", [0, -1, 2.5, "8", None])
def test_bad_budget(name, budget):
    with pytest.raises(ValueError, match=f"{BUDGET}={budget!r}".replace(".", r"\.")):
        build_scheduler(name, dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=budget)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("min_cp", [0, -2, 3, 6, 8, 16])
def test_bad_min_cp(name, min_cp):
    """Not a power of two, or larger than N = 4."""
    with pytest.raises(ValueError, match=f"{MIN_CP}={min_cp}"):
        build_scheduler(name, dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8, min_cp_size=min_cp)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("vpp", [0, -1, True, 1.5])
def test_bad_vpp_group_size(name, vpp):
    with pytest.raises(ValueError, match=VPP):
        build_scheduler(
            name,
            dp_size=2,
            cp_size=2,
            max_seqlen_per_dp_cp_rank=8,
            microbatch_group_size_per_vp_stage=vpp,
        )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dp,cp", [(0, 2), (2, 0), (-1, 1), (1.0, 2)])
def test_bad_domain_size(name, dp, cp):
    with pytest.raises(ValueError, match="must be a positive integer"):
        build_scheduler(name, dp_size=dp, cp_size=cp, max_seqlen_per_dp_cp_rank=8)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True, 2.0])
def test_bad_length_names_the_sample(name, bad):
    scheduler = build_scheduler(name, dp_size=1, cp_size=2, max_seqlen_per_dp_cp_rank=8)
    with pytest.raises(ValueError, match=r"seqlens\[1\]="):
        scheduler.schedule([3, bad, 4])


@pytest.mark.parametrize("name", NAMES)
def test_too_long_sequence_names_the_flag_the_value_and_the_fix(name):
    scheduler = build_scheduler(name, dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8)
    with pytest.raises(ValueError, match=f"{BUDGET}=8") as info:
        scheduler.schedule([1, 33, 2])
    assert "sample 1" in str(info.value) and "33" in str(info.value)
    # the smallest budget that fits 33 tokens on 4 ranks (9), rounded up to what training takes
    assert "at least 10" in str(info.value)


def test_dp_balanced_needs_a_cp_group_of_cp_size():
    with pytest.raises(ValueError, match="cp_size=3"):
        build_scheduler("dp_balanced", dp_size=2, cp_size=3, max_seqlen_per_dp_cp_rank=8)
    with pytest.raises(ValueError, match="cp_size=2"):
        build_scheduler(
            "dp_balanced", dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8, min_cp_size=4
        )
    build_scheduler(
        "dp_balanced", dp_size=1, cp_size=3, max_seqlen_per_dp_cp_rank=8
    )  # whole domain


def test_dp_balanced_sequence_longer_than_static_cp_names_the_flag():
    scheduler = build_scheduler("dp_balanced", dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8)
    with pytest.raises(ValueError, match=BUDGET):
        scheduler.schedule([17, 1])


def test_inputs_are_accepted_as_any_iterable_of_ints():
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=2, cp_size=1, max_seqlen_per_dp_cp_rank=8
    )
    plan = scheduler.schedule(iter([3, 4, 5]))
    assert plan.seqlens == (3, 4, 5) and plan == scheduler.schedule((3, 4, 5))


# ------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------


def test_registry_holds_the_builtin_schedulers():
    assert {"default_dynamic_cp", "dp_balanced"} <= set(SCHEDULERS)
    for name in NAMES:
        scheduler = build_scheduler(name, dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8)
        assert isinstance(scheduler, SCHEDULERS[name]) and scheduler.name == name


def test_registering_a_scheduler_by_subclassing(registered_names):
    registered_names.append("test_one_sample_per_microbatch")

    class OneSamplePerMicroBatch(Scheduler, name="test_one_sample_per_microbatch"):
        def _schedule(self, seqlens):
            whole = tuple(range(self.domain.size))
            return [MicroBatch((CPGroup(whole, (i,)),)) for i in range(len(seqlens))]

    assert SCHEDULERS["test_one_sample_per_microbatch"] is OneSamplePerMicroBatch
    scheduler = build_scheduler(
        "test_one_sample_per_microbatch", dp_size=2, cp_size=3, max_seqlen_per_dp_cp_rank=4
    )
    plan = scheduler.schedule([1, 24, 3])
    assert plan.num_microbatches == 3 and check_plan(plan, (1, 24, 3), plan.domain, None) == []
    with pytest.raises(ValueError, match="already registered"):

        class Duplicate(Scheduler, name="test_one_sample_per_microbatch"):
            pass


def test_a_scheduler_that_returns_a_broken_plan_is_caught(registered_names):
    registered_names.append("test_idle_ranks")

    class IdleRanks(Scheduler, name="test_idle_ranks"):
        def _schedule(self, seqlens):
            groups = (CPGroup((0,), tuple(range(len(seqlens)))), CPGroup((1,), ()))
            return [MicroBatch(groups)]

    with pytest.raises(InvalidPlanError, match="idle"):
        build_scheduler(
            "test_idle_ranks", dp_size=2, cp_size=1, max_seqlen_per_dp_cp_rank=8
        ).schedule([1])


def test_unknown_scheduler_names_the_parameter_and_the_choices():
    with pytest.raises(ValueError, match="scheduler='nope'") as info:
        build_scheduler("nope", dp_size=1, cp_size=1, max_seqlen_per_dp_cp_rank=8)
    assert "default_dynamic_cp" in str(info.value) and "dp_balanced" in str(info.value)


# ------------------------------------------------------------------------------------------------
# The garbage collector while a plan is made
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fail", [False, True])
def test_collector_paused_while_planning_and_restored(registered_names, enabled, fail):
    """Planning runs with the cyclic collector off and leaves it as it found it (on, or off as
    megatron's --manual-gc leaves it), also when planning raises."""
    registered_names.append("test_collector_probe")
    seen = []

    class CollectorProbe(Scheduler, name="test_collector_probe"):
        def _schedule(self, seqlens):
            seen.append(gc.isenabled())
            if fail:
                raise RuntimeError("planning failed")
            whole = tuple(range(self.domain.size))
            return [MicroBatch((CPGroup(whole, (i,)),)) for i in range(len(seqlens))]

    probe = build_scheduler(
        "test_collector_probe", dp_size=2, cp_size=1, max_seqlen_per_dp_cp_rank=8
    )
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        if fail:
            with pytest.raises(RuntimeError, match="planning failed"):
                probe.schedule([4, 4])
        else:
            probe.schedule([4, 4])
        assert seen == [False] and gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
