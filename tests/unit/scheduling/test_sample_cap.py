"""The cap on samples per CP group (``scheduling.sample_cap``): every scheduler's plan holds it,
keeps every sample once and stays VPP-aligned; a group over the cap keeps its longest samples;
no cap, no change; ``validate()`` refuses a plan over the cap."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dcp.scheduling import SCHEDULERS, build_scheduler
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.plan import CPGroup, InvalidPlanError, MicroBatch, Plan
from megatron_dcp.scheduling.sample_cap import capped


@settings(max_examples=60)
@given(
    name=st.sampled_from(sorted(SCHEDULERS)),
    dp=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
    vpp=st.sampled_from([None, 2]),
    cap=st.integers(1, 4),
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40),
)
def test_every_plan_holds_the_cap(name, dp, cp, vpp, cap, lengths):
    kwargs = dict(dp_size=dp, cp_size=cp, max_seqlen_per_dp_cp_rank=64)
    kwargs.update(microbatch_group_size_per_vp_stage=vpp)
    try:
        uncapped = build_scheduler(name, **kwargs).schedule(lengths)
    except SchedulingError:
        assume(False)  # no plan without the cap either (too few samples for VPP or static CP)
    plan = build_scheduler(name, max_samples_per_group=cap, **kwargs).schedule(lengths)
    assert all(len(g.sample_ids) <= cap for mb in plan.microbatches for g in mb.groups)
    ids = sorted(i for mb in plan.microbatches for g in mb.groups for i in g.sample_ids)
    assert ids == list(range(len(lengths)))  # validate() checked alignment and budget too
    most = max(len(g.sample_ids) for mb in uncapped.microbatches for g in mb.groups)
    if most <= cap:
        assert plan.microbatches == uncapped.microbatches


def test_a_full_group_keeps_its_longest_samples():
    lengths = [5, 40, 9, 30, 1]
    microbatches = [MicroBatch((CPGroup((0,), (0, 1, 2, 3, 4)),))]
    replanned = []

    def replan(sub):
        replanned.append(sub)
        return [
            MicroBatch(
                (
                    CPGroup(
                        (0,),
                        tuple(range(len(sub))),
                    ),
                )
            )
        ]

    result = capped(microbatches, lengths, 3, replan)
    assert result[0].groups[0].sample_ids == (1, 3, 2)
    assert replanned == [(0, 4)] and result[1].groups[0].sample_ids == (0, 4)


def test_validate_refuses_a_group_over_the_cap():
    scheduler = build_scheduler("dp_balanced", dp_size=1, cp_size=1, max_seqlen_per_dp_cp_rank=64)
    plan = scheduler.schedule([3, 4, 5])
    over = Plan(plan.seqlens, plan.domain, plan.microbatches, None, max_samples_per_group=2)
    with pytest.raises(InvalidPlanError, match="3 samples exceed the cap 2"):
        over.validate()


@pytest.mark.parametrize("cap", [0, -1, 1.5, True])
def test_a_bad_cap_is_refused(cap):
    with pytest.raises(SchedulingError, match="max_samples_per_group"):
        build_scheduler(
            "default_dynamic_cp",
            dp_size=1,
            cp_size=2,
            max_seqlen_per_dp_cp_rank=8,
            max_samples_per_group=cap,
        )
