"""Unit tests of plan checking: ``Plan.validate()`` on hand-made broken plans (one per invariant)
with the independent checker agreeing, and the fuzz harness itself (feasibility bounds, case
accounting, shrinking). Pure Python, no hypothesis."""

from dataclasses import replace

import pytest

from megatron_dcp.scheduling import CPGroup, Domain, InvalidPlanError, MicroBatch, Plan, Scheduler
from megatron_dcp.scheduling.cost import build_cost_model
from megatron_dcp.tools.fuzz_cases import SEQUENCE_TOKENS, draw_case
from megatron_dcp.tools.plan_check import check_plan, min_bins_bounds
from megatron_dcp.tools.plan_fuzzer import run_fuzz

# ------------------------------------------------------------------------------------------------
# Plan.validate() on hand-made broken plans (one per invariant); the fuzz checker agrees
# ------------------------------------------------------------------------------------------------

DOMAIN = Domain(2, 2, 10)  # N = 4, budget 10
SEQLENS = (5, 6, 7, 8, 20)


def mb(*groups) -> MicroBatch:
    return MicroBatch(tuple(CPGroup(tuple(ranks), tuple(ids)) for ranks, ids in groups))


VALID = Plan(
    SEQLENS,
    DOMAIN,
    (
        mb(((0, 1), (0, 1)), ((2,), (2,)), ((3,), (3,))),
        mb(((0, 1, 2, 3), (4,))),
    ),
)


def assert_broken(plan: Plan, match: str) -> None:
    with pytest.raises(InvalidPlanError, match=match):
        plan.validate()
    assert check_plan(plan, plan.seqlens, plan.domain, plan.microbatch_group_size_per_vp_stage)


def test_valid_plan_passes():
    assert VALID.validate() is VALID
    assert check_plan(VALID, SEQLENS, DOMAIN, None) == []
    assert replace(VALID, microbatch_group_size_per_vp_stage=2).validate()


def test_validate_catches_a_duplicated_sample():
    plan = replace(VALID, microbatches=(VALID.microbatches[0], mb(((0, 1, 2, 3), (4, 0)))))
    assert_broken(plan, r"exactly once.*duplicated \[0\]")


def test_validate_catches_a_missing_sample():
    assert_broken(replace(VALID, seqlens=SEQLENS + (1,)), r"missing \[5\]")


def test_validate_catches_overlapping_groups():
    plan = replace(
        VALID, microbatches=(mb(((0, 1), (0, 1)), ((0, 1, 2, 3), (2, 3))), VALID.microbatches[1])
    )
    assert_broken(plan, "do not partition")


def test_validate_catches_an_uncovered_position():
    plan = replace(
        VALID, microbatches=(mb(((0, 1), (0, 1)), ((2,), (2, 3))), VALID.microbatches[1])
    )
    assert_broken(plan, "do not partition")


@pytest.mark.parametrize(
    "groups",
    [
        (((0,), (0,)), ((1, 2), (1, 2)), ((3,), (3,))),  # size 2 starting at 1: unaligned
        (((0, 1, 2), (0, 1, 2)), ((3,), (3,))),  # size 3 in N = 4: no such group
        (((0, 2), (0, 1)), ((1,), (2,)), ((3,), (3,))),  # not contiguous
    ],
)
def test_validate_catches_a_block_without_a_cp_group(groups):
    plan = replace(VALID, microbatches=(mb(*groups), VALID.microbatches[1]))
    assert_broken(plan, "not an aligned block")


def test_validate_catches_a_group_below_min_cp():
    plan = replace(VALID, domain=Domain(2, 2, 10, min_cp_size=2))
    assert_broken(plan, "not an aligned block")


def test_validate_catches_an_over_budget_group():
    assert_broken(replace(VALID, seqlens=(5, 6, 11, 8, 20)), "exceed the budget 10")


def test_validate_catches_an_idle_group():
    plan = replace(
        VALID,
        microbatches=(mb(((0, 1), (0, 1, 2)), ((2,), ()), ((3,), (3,))), VALID.microbatches[1]),
    )
    assert_broken(plan, "idle")


@pytest.mark.parametrize("k", [3, 4])  # 4: a group size the count of 2 divides, not the reverse
def test_validate_catches_vpp_misalignment(k):
    assert_broken(replace(VALID, microbatch_group_size_per_vp_stage=k), "not a multiple")


def test_a_vpp_group_size_dividing_the_micro_batch_count_passes():
    plan = Plan((1, 2, 3, 4), DOMAIN, tuple(mb(((0, 1, 2, 3), (i,))) for i in range(4)), 2)
    assert plan.validate() is plan
    assert check_plan(plan, plan.seqlens, DOMAIN, 2) == []


def test_groups_filled_exactly_to_their_budget_pass():
    """The budget is inclusive: 10 tokens on one rank, 40 on four (budget 10)."""
    plan = replace(VALID, seqlens=(5, 6, 10, 8, 40))
    assert plan.validate() is plan
    assert check_plan(plan, plan.seqlens, DOMAIN, None) == []


# ------------------------------------------------------------------------------------------------
# The fuzz harness itself
# ------------------------------------------------------------------------------------------------


def test_min_bins_bounds():
    assert min_bins_bounds([], 10) == (0, 0)
    assert min_bins_bounds([6, 6, 6], 10) == (3, 3)  # each > C/2
    assert min_bins_bounds([5, 5, 5, 5], 10) == (2, 2)
    # optimum 3 (4+3+3 three times); first-fit decreasing needs 4
    assert min_bins_bounds([4, 4, 4, 3, 3, 3, 3, 3, 3], 10) == (3, 4)


def test_run_fuzz_accounts_for_every_case():
    result = run_fuzz(10, seed=3)
    assert result.cases == 10 and len(result.violations) <= 20
    for counts in result.per_scheduler.values():
        assert counts.planned + counts.skipped_invalid + counts.violations == 10


def test_run_fuzz_catches_and_shrinks_a_broken_scheduler(registered_names):
    registered_names.append("test_unchecked_single_microbatch")

    class UncheckedSingleMicroBatch(Scheduler, name="test_unchecked_single_microbatch"):
        """Everything in one whole-domain group, ignoring the budget; skips validate()."""

        def schedule(self, seqlens):
            lengths = self.domain.check_seqlens(seqlens)
            whole = CPGroup(tuple(range(self.domain.size)), tuple(range(len(lengths))))
            microbatches = (MicroBatch((whole,)),) if lengths else ()
            vpp = self.microbatch_group_size_per_vp_stage
            return Plan(lengths, self.domain, microbatches, vpp)

    result = run_fuzz(40, seed=1, schedulers=("test_unchecked_single_microbatch",))
    assert result.violation_count > 0 and result.violations
    assert any("tokens >" in text for text in result.violations)
    reproducer = result.violations[0].split(" | ")[1]
    assert reproducer.startswith("build_scheduler('test_unchecked_single_microbatch'")


def test_fuzz_cases_draw_a_cost_per_sequence_without_changing_their_domains_or_lengths():
    """The cost per sequence has its own random stream, so a seed's domains and lengths are what
    they were before it (``test_plan_digests`` pins the plans of seed 0's first 60 cases); a
    case's reproducer names the cost model it planned with."""
    cases = [draw_case(0, index) for index in range(200)]
    drawn = {case.sequence_tokens for case in cases}
    assert drawn == set(SEQUENCE_TOKENS) and 0.0 in drawn
    for case in cases:
        assert case.cost_model().sequence == case.sequence_tokens * build_cost_model().linear
        assert ("cost_model=replace(" in case.reproducer("default_dynamic_cp")) == bool(
            case.sequence_tokens
        )
    plain = replace(cases[0], sequence_tokens=0.0)
    assert plain.cost_model() == build_cost_model()
