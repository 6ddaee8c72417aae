"""The plan-consistency guard: ranks holding the same plan pass with one all-reduce; one rank
that planned differently makes every rank raise ``PlanMismatchError`` naming the global batch
and the first micro-batch that differs (no hang). Through ``DCPForwardBackward.prepare`` too:
a CP rank whose samples differ is caught before routing."""

from __future__ import annotations

import pytest

from megatron_dcp.runtime.plan_guard import PlanMismatchError, check_same_plan, first_difference
from megatron_dcp.scheduling import build_scheduler
from megatron_dcp.testing import run_distributed

LENGTHS = [300, 20, 30, 90, 10, 64, 1, 7, 200, 120, 33, 80]
TIMEOUT_S = 60


def plan_of(lengths):
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=100, min_cp_size=1
    )
    return scheduler.schedule(lengths)


def guard(rank: int, world_size: int, perturbed: int) -> str:
    lengths = list(LENGTHS)
    if rank == perturbed:
        lengths[-1] += 1  # the last sample: the plans agree on the micro-batches before its own
    try:
        check_same_plan(plan_of(lengths), None, step=7)
    except PlanMismatchError as error:
        return str(error)
    return "same"


def test_same_plans_pass():
    assert run_distributed(guard, 4, -1, timeout_s=TIMEOUT_S) == ["same"] * 4


def test_one_perturbed_rank_fails_every_rank_with_the_first_differing_microbatch():
    plan, other = plan_of(LENGTHS), plan_of(LENGTHS[:-1] + [LENGTHS[-1] + 1])
    index = first_difference([plan.microbatch_digests(), other.microbatch_digests()])
    messages = run_distributed(guard, 4, 2, timeout_s=TIMEOUT_S)
    for message in messages:
        assert "global batch 7" in message and f"from micro-batch {index} on" in message
        assert "ranks [2] do not" in message


def test_first_difference_counts_a_missing_microbatch():
    assert first_difference([(1, 2), (1, 2)]) == 2
    assert first_difference([(1, 2), (1, 3)]) == 1
    assert first_difference([(1, 2), (1,)]) == 1


def test_digest_follows_every_field():
    plan = plan_of(LENGTHS)
    assert plan.digest() == plan_of(LENGTHS).digest()
    assert 0 <= plan.digest() < 2**63
    assert plan.digest() != plan_of(LENGTHS[:-1] + [LENGTHS[-1] + 1]).digest()
    swapped = type(plan)(plan.seqlens, plan.domain, plan.microbatches[::-1])
    assert swapped.microbatch_digests() == plan.microbatch_digests()[::-1]
    assert swapped.digest() != plan.digest()


@pytest.mark.parametrize("perturbed", [0, 3])
def test_message_names_the_disagreeing_rank(perturbed):
    messages = run_distributed(guard, 4, perturbed, timeout_s=TIMEOUT_S)
    assert all(f"ranks [{perturbed}] do not" in message for message in messages)
