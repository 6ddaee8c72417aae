"""Unit tests of the scheduling layer: domain rules, input validation, registry, plan validation,
cost model and the named steps of ``default_dynamic_cp``. Pure Python, no hypothesis."""

from dataclasses import replace

import pytest

from megatron_dcp.scheduling import (
    SCHEDULERS,
    CostModel,
    CPGroup,
    Domain,
    InvalidPlanError,
    MicroBatch,
    ModelShape,
    Plan,
    Scheduler,
    build_cost_model,
    build_scheduler,
)
from megatron_dcp.scheduling.balance import align_microbatch_count
from megatron_dcp.scheduling.buddy import BuddyAllocator
from megatron_dcp.scheduling.default_dynamic_cp import (
    Context,
    align_to_vpp,
    critical_path,
    equalize_buckets,
    fill_empty_ranks,
    fill_level,
    heaviest_first,
    is_heavy,
    next_hdp_group,
    plan_rows,
    promotion_waste,
    rebalance_row,
    trial_sizes,
)
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import Item, group_of_items
from megatron_dcp.tools.fuzz import check_plan, min_bins_bounds, run_fuzz

NAMES = ("default_dynamic_cp", "dp_balanced")
# Scheduling errors name the scheduling parameters (the flags come from the layers above).
BUDGET, MIN_CP, VPP = "budget", "min_cp_size", "microbatch_group_size_per_vp_stage"


def is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def covered(groups) -> list:
    return sorted(p for g in groups for p in g.block.positions)


# ------------------------------------------------------------------------------------------------
# Domain: CP degree rule, group sizes, children
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dp,cp,min_cp,expected",
    [
        # N = 8, budget 10: the smallest power of two c with L / c ≤ 10.
        (1, 8, 1, {0: 1, 1: 1, 10: 1, 11: 2, 20: 2, 21: 4, 40: 4, 41: 8, 80: 8}),
        (1, 8, 2, {0: 2, 1: 2, 20: 2, 21: 4, 80: 8}),
        # N = 6: powers of two up to 4, then the whole (non-power-of-two) domain.
        (6, 1, 1, {10: 1, 11: 2, 40: 4, 41: 6, 60: 6}),
        # N = 12, min CP 4.
        (3, 4, 4, {0: 4, 40: 4, 41: 8, 80: 8, 81: 12, 120: 12}),
    ],
)

def test_cp_degree_examples(dp, cp, min_cp, expected):
    domain = Domain(dp, cp, 10, min_cp)
    assert {length: domain.cp_degree(length) for length in expected} == expected
    with pytest.raises(ValueError, match=BUDGET):
        domain.cp_degree(domain.size * 10 + 1)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 8, 12, 24, 31, 48, 64])
def test_cp_degree_rule_for_every_length(n):
    """Smallest power of two c ≥ min_cp (c ≤ N) with L / c ≤ budget, else N (whole domain)."""
    budget = 3
    for min_cp in [1 << k for k in range(n.bit_length())]:
        domain = Domain(n, 1, budget, min_cp)
        for length in range(n * budget + 1):
            fitting = [c for c in range(min_cp, n + 1) if is_pow2(c) and length <= c * budget]
            assert domain.cp_degree(length) == (min(fitting) if fitting else n), (n, min_cp, length)


@pytest.mark.parametrize(
    "n,min_cp,sizes",
    [
        (1, 1, (1,)),
        (6, 1, (1, 2, 4, 6)),
        (6, 4, (4, 6)),
        (8, 1, (1, 2, 4, 8)),
        (8, 8, (8,)),
        (12, 1, (1, 2, 4, 8, 12)),
        (12, 4, (4, 8, 12)),
        (24, 1, (1, 2, 4, 8, 16, 24)),
        (24, 8, (8, 16, 24)),
        (24, 16, (16, 24)),
    ],
)
def test_group_sizes(n, min_cp, sizes):
    assert Domain(n, 1, 4, min_cp).group_sizes == sizes
    if n % 2 == 0:
        assert Domain(2, n // 2, 4, min_cp).group_sizes == sizes  # only N matters, not dp × cp


@pytest.mark.parametrize(
    "n,min_cp,block,children",
    [
        (8, 1, Block(0, 8), [Block(0, 4), Block(4, 4)]),
        (8, 1, Block(4, 2), [Block(4, 1), Block(5, 1)]),
        (8, 1, Block(3, 1), []),
        (8, 4, Block(0, 8), [Block(0, 4), Block(4, 4)]),
        (8, 4, Block(0, 4), []),
        (6, 1, Block(0, 6), [Block(0, 4), Block(4, 2)]),
        (7, 1, Block(0, 7), [Block(0, 4), Block(4, 2), Block(6, 1)]),
        (12, 4, Block(0, 12), [Block(0, 8), Block(8, 4)]),
        (6, 4, Block(0, 6), []),  # the 2-rank piece would be below min CP
        (24, 8, Block(0, 24), [Block(0, 16), Block(16, 8)]),
    ],
)
def test_children(n, min_cp, block, children):
    domain = Domain(n, 1, 4, min_cp)
    assert list(domain.children(block)) == children
    assert all(domain.is_group_block(child) for child in children)


@pytest.mark.parametrize(
    "n,min_cp,block,ok",
    [
        (6, 1, Block(0, 6), True),
        (6, 1, Block(4, 2), True),
        (6, 1, Block(2, 2), True),
        (6, 1, Block(1, 2), False),
        (6, 1, Block(4, 4), False),
        (6, 1, Block(0, 3), False),
        (8, 2, Block(3, 1), False),
        (8, 2, Block(2, 2), True),
    ],
)
def test_is_group_block(n, min_cp, block, ok):
    assert Domain(n, 1, 4, min_cp).is_group_block(block) is ok


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
    assert "at least 9" in str(info.value)  # the smallest budget that fits 33 tokens on 4 ranks


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


@pytest.fixture
def registered_names():
    """Names registered by a test are removed afterwards, so the test can run again."""
    names = []
    yield names
    for name in names:
        SCHEDULERS.pop(name, None)


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


def test_validate_catches_vpp_misalignment():
    assert_broken(replace(VALID, microbatch_group_size_per_vp_stage=3), "not a multiple")


# ------------------------------------------------------------------------------------------------
# Cost model
# ------------------------------------------------------------------------------------------------

MODEL = CostModel.from_model_shape()


@pytest.mark.parametrize("length", [1, 100, 4096, 131072])
def test_per_rank_cost_at_cp1_has_no_overhead(length):
    assert MODEL.overhead(length, 1) == 0.0
    assert MODEL.per_rank(length, 1) == MODEL.linear * length + MODEL.quadratic * length**2


@pytest.mark.parametrize("length", [1, 100, 4096, 131072])
def test_overhead_grows_with_the_cp_size(length):
    overheads = [MODEL.overhead(length, c) for c in (1, 2, 4, 8, 16, 64)]
    assert overheads[0] == 0.0 and all(a < b for a, b in zip(overheads, overheads[1:]))
    for c in (2, 4, 8, 6):
        expected = MODEL.work(length) / c + MODEL.comm * length * (c - 1) / c
        assert MODEL.per_rank(length, c) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("length,c", [(0, 1), (7, 1), (1000, 4), (4096, 6), (65536, 64)])
def test_attention_only_is_l_squared_over_c(length, c):
    cost = CostModel.attention_only()
    assert cost.per_rank(length, c) == pytest.approx(length * length / c, rel=1e-12)
    assert cost.overhead(length, c) == 0.0


def test_custom_cost_model_formula():
    cost = CostModel(linear=2.0, quadratic=0.5, comm=3.0)
    assert cost.per_rank(10, 1) == 2.0 * 10 + 0.5 * 100
    assert cost.per_rank(10, 4) == pytest.approx((2.0 * 10 + 0.5 * 100) / 4 + 3.0 * 10 * 3 / 4)


def test_cost_model_shape_sets_the_coefficients():
    small, large = (
        CostModel.from_model_shape(ModelShape(hidden_size=1024, ffn_hidden_size=4096)),
        MODEL,
    )
    assert 0 < small.linear < large.linear and 0 < small.quadratic < large.quadratic
    assert 0 < small.comm <= large.comm


@pytest.mark.parametrize(
    "coefficients", [(-1.0, 1.0, 0.0), (1.0, -1.0, 0.0), (1.0, 1.0, -1.0), (0.0, 0.0, 1.0)]
)
def test_cost_model_rejects_bad_coefficients(coefficients):
    with pytest.raises(ValueError, match="coefficients"):
        CostModel(*coefficients)


def test_build_cost_model():
    assert build_cost_model("model") == MODEL
    assert build_cost_model("attention") == CostModel.attention_only()
    with pytest.raises(ValueError, match="cost_model='flops'"):
        build_cost_model("flops")


# ------------------------------------------------------------------------------------------------
# The named steps of default_dynamic_cp
# ------------------------------------------------------------------------------------------------


def context(n: int = 8, budget: int = 100, min_cp: int = 1, cost: CostModel = MODEL) -> Context:
    return Context(Domain(n, 1, budget, min_cp), cost)


def items_of(ctx: Context, lengths) -> list:
    return [Item(i, length, ctx.domain.cp_degree(length)) for i, length in enumerate(lengths)]


@pytest.mark.parametrize(
    "count,group,aligned",
    [(5, None, 5), (5, 1, 5), (5, 4, 8), (8, 4, 8), (0, 4, 0), (1, 3, 3), (7, 2, 8), (9, 3, 9)],
)
def test_align_microbatch_count(count, group, aligned):
    assert align_microbatch_count(count, group) == aligned


def test_heaviest_first_orders_by_least_work_then_id():
    ctx = context(n=4, budget=100)
    items = items_of(ctx, [5, 300, 5, 0, 120])
    assert [i.sample_id for i in heaviest_first(ctx, items)] == [1, 4, 0, 2, 3]


def test_fill_level_is_the_mean_load_over_the_fewest_microbatches():
    ctx = context(n=4, budget=100, cost=CostModel.attention_only())
    items = items_of(ctx, [100] * 6)  # 600 tokens: 2 micro-batches of 400
    assert fill_level(ctx, items) == pytest.approx(6 * 100**2 / (4 * 2))
    assert fill_level(ctx, items_of(ctx, [0, 0])) == 0.0


def test_equalize_buckets_partitions_with_equal_work():
    ctx = context(n=4, budget=1000)
    lengths = [3000, 2500, 40, 40, 900, 1200, 17, 600, 600, 2000, 10, 1]
    items = items_of(ctx, lengths)
    buckets = equalize_buckets(ctx, items)
    assert len(buckets) == 3 and all(buckets)  # ⌈10 908 tokens / 4000⌉
    assert sorted(i.sample_id for b in buckets for i in b) == list(range(len(items)))
    assert all(sum(i.seqlen for i in b) <= 4 * 1000 for b in buckets)
    works = [sum(ctx.min_work(i) for i in b) for b in buckets]
    assert max(works) - min(works) <= max(ctx.min_work(i) for i in items)  # LPT's guarantee


def test_equalize_buckets_adds_buckets_when_tokens_do_not_fit_and_spreads_zero_lengths():
    ctx = context(n=2, budget=10)
    assert len(equalize_buckets(ctx, items_of(ctx, [20, 20, 20]))) == 3  # 60 tokens, 20 each
    zeros = equalize_buckets(ctx, items_of(ctx, [0, 0, 0, 20, 20]))
    assert len(zeros) == 2 and all(zeros)


@pytest.mark.parametrize("n", [1, 3, 6, 8, 12])
@pytest.mark.parametrize("lengths", [[100, 3, 7], [90] * 20, [799, 400, 1, 1, 1, 250, 60, 0]])
def test_next_hdp_group_partitions_the_domain_and_returns_leftovers(n, lengths):
    ctx = context(n=n, budget=100)
    lengths = [min(length, n * 100) for length in lengths]
    items = heaviest_first(ctx, items_of(ctx, lengths))
    groups, leftovers = next_hdp_group(ctx, items)
    placed = [i for g in groups for i in g.items]
    assert sorted(placed + leftovers, key=lambda i: i.sample_id) == sorted(
        items, key=lambda i: i.sample_id
    )
    assert groups and covered(groups) == list(range(n))
    assert [i.sample_id for i in leftovers] == [i.sample_id for i in items if i in leftovers]
    for g in groups:
        assert g.items and ctx.domain.is_group_block(g.block)
        assert g.tokens == sum(i.seqlen for i in g.items) <= g.size * 100
        assert all(i.min_cp <= g.size for i in g.items)
        assert g.load == pytest.approx(sum(ctx.cost.per_rank(i.seqlen, g.size) for i in g.items))


def test_next_hdp_group_fewer_samples_than_ranks_expands_groups():
    ctx = context(n=8, budget=64)
    groups, leftovers = next_hdp_group(ctx, heaviest_first(ctx, items_of(ctx, [100, 3, 7])))
    assert not leftovers and covered(groups) == list(range(8))
    assert all(g.items for g in groups) and len(groups) <= 3


def test_next_hdp_group_gives_a_short_sequence_a_larger_group_when_that_balances():
    """Attention cost (no CP overhead): one long and many short samples; the long one is spread
    over more ranks than its minimum so that its group's load matches the others."""
    ctx = context(n=8, budget=1000, cost=CostModel.attention_only())
    items = heaviest_first(ctx, items_of(ctx, [1000] + [250] * 16))
    groups, leftovers = next_hdp_group(ctx, items)
    long_group = next(g for g in groups if any(i.sample_id == 0 for i in g.items))
    assert long_group.size > 1 and not leftovers
    assert max(g.load for g in groups) < ctx.cost.per_rank(1000, 1)


def test_trial_sizes_start_at_the_size_that_meets_the_level():
    ctx = context(n=8, budget=1000, cost=CostModel.attention_only())
    item = Item(0, 100, 1)
    assert trial_sizes(ctx, item, floor=100**2) == [1]  # fits the level alone
    assert trial_sizes(ctx, item, floor=100**2 / 3) == [4, 2, 1]  # 10⁴/4 ≤ 10⁴/3 first
    assert trial_sizes(ctx, item, floor=0.0) == [8, 4, 2]


def test_trial_sizes_respect_min_cp_the_domain_and_rising_costs():
    six = context(n=6, budget=1000, cost=CostModel.attention_only())
    assert trial_sizes(six, Item(0, 100, 1), floor=0.0)[0] == 6  # whole non-power-of-two domain
    three = context(n=3, budget=4, min_cp=2)
    assert trial_sizes(three, Item(0, 0, 2), floor=0.0) == [3]  # size 2 cannot tile N = 3
    dear = context(n=8, budget=1000, cost=CostModel(linear=1.0, quadratic=0.0, comm=10.0))
    assert trial_sizes(dear, Item(0, 100, 1), floor=0.0) == [1]


def test_promotion_waste_and_is_heavy():
    ctx = context(n=8, budget=100)
    item = Item(0, 100, 1)
    load = ctx.cost.per_rank(100, 1)
    assert promotion_waste(ctx, item, load) == 0.0
    expected = ctx.cost.per_rank(100, 2) * 2 / load - 1
    assert promotion_waste(ctx, item, ctx.cost.per_rank(100, 2)) == pytest.approx(expected)
    assert not is_heavy(ctx, items_of(ctx, [100] * 8))
    attention = context(n=8, budget=100, cost=CostModel.attention_only())
    assert not is_heavy(attention, items_of(attention, [800] + [1] * 8))  # CP is free there
    comm = context(n=8, budget=100, cost=CostModel(linear=1.0, quadratic=0.0, comm=1.0))
    assert is_heavy(comm, items_of(comm, [100] + [1] * 100))


def test_fill_empty_ranks_takes_samples_from_groups_that_hold_several():
    ctx = context(n=4, budget=100, cost=CostModel.attention_only())
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(1), items_of(ctx, [10, 20, 30, 40]), ctx.cost)]
    fill_empty_ranks(ctx, groups, free)
    assert not free.free and covered(groups) == [0, 1, 2, 3]
    assert all(g.items for g in groups) and len(groups) == 3
    assert sorted(i.sample_id for g in groups for i in g.items) == [0, 1, 2, 3]


def test_fill_empty_ranks_merges_when_no_sample_can_be_spared():
    ctx = context(n=4, budget=100)
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(1), items_of(ctx, [10]), ctx.cost)]
    fill_empty_ranks(ctx, groups, free)
    assert [(g.block, [i.sample_id for i in g.items]) for g in groups] == [(Block(0, 4), [0])]


def test_fill_empty_ranks_takes_a_spare_sample_before_merging():
    ctx = context(n=4, budget=100)
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(2), items_of(ctx, [10]), ctx.cost)]
    spare = [Item(1, 300, 4), Item(2, 90, 1), Item(3, 5, 1)]  # heaviest first; 300 needs 4 ranks
    fill_empty_ranks(ctx, groups, free, spare)
    assert [(g.block, [i.sample_id for i in g.items]) for g in groups] == [
        (Block(0, 2), [0]),
        (Block(2, 2), [3]),  # the lightest spare that fits the free block
    ]
    assert [i.sample_id for i in spare] == [1, 2]


def test_fill_empty_ranks_reunites_free_buddies_before_merging_groups():
    ctx = context(n=4, budget=100)
    free = BuddyAllocator(ctx.domain)
    groups = [group_of_items(free.allocate(2), items_of(ctx, [10]), ctx.cost)]
    free.free = [Block(2, 1), Block(3, 1)]  # buddies given back separately
    fill_empty_ranks(ctx, groups, free)
    assert [(g.block, [i.sample_id for i in g.items]) for g in groups] == [(Block(0, 4), [0])]
    assert all(g.items for g in groups)


def test_rebalance_row_lowers_the_maximum():
    ctx = context(n=2, budget=100, cost=CostModel.attention_only())
    free = BuddyAllocator(ctx.domain)
    heavy = group_of_items(free.allocate(1), items_of(ctx, [30, 30, 30]), ctx.cost)
    light = group_of_items(free.allocate(1), [Item(3, 1, 1)], ctx.cost)
    before = heavy.load
    rebalance_row(ctx, [heavy, light])
    assert max(heavy.load, light.load) < before and len(heavy.items) == 2
    assert heavy.load == pytest.approx(2 * 30**2) and light.load == pytest.approx(30**2 + 1)


@pytest.mark.parametrize("vpp", [2, 3, 4])
def test_align_to_vpp_splits_microbatches(vpp):
    ctx = context(n=4, budget=100)
    items = items_of(ctx, [90, 80, 70, 60, 50, 40, 30, 20, 10, 5, 1, 0])
    rows = plan_rows(ctx, heaviest_first(ctx, items))
    aligned = align_to_vpp(ctx, rows, items, vpp)
    assert len(aligned) % vpp == 0 and len(aligned) >= len(rows)
    assert sorted(i.sample_id for row in aligned for g in row for i in g.items) == list(range(12))
    assert all(covered(row) == [0, 1, 2, 3] and all(g.items for g in row) for row in aligned)
    assert critical_path(aligned) > 0


def test_align_to_vpp_falls_back_to_whole_domain_microbatches_or_names_the_flag():
    ctx = context(n=1, budget=2)
    items = items_of(ctx, [2, 1, 1])  # 3 micro-batches laid out; 2 whole-domain ones suffice
    rows = [[group_of_items(Block(0, 1), [item], ctx.cost)] for item in items]
    aligned = align_to_vpp(ctx, rows, items, 2)
    assert [[i.sample_id for i in row[0].items] for row in aligned] == [[0], [1, 2]]
    full = items_of(ctx, [2, 2, 2])
    rows = [[group_of_items(Block(0, 1), [item], ctx.cost)] for item in full]
    with pytest.raises(ValueError, match=VPP):
        align_to_vpp(ctx, rows, full, 2)
    assert align_to_vpp(ctx, rows, full, None) is rows


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
