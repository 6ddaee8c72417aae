"""Unit tests of the domain rules (CP degree, group sizes, children, group blocks) and of the
cost model. Pure Python, no hypothesis."""

from dataclasses import replace

import pytest

from megatron_dcp.scheduling import CostModel, Domain, ModelShape, build_cost_model
from megatron_dcp.scheduling.domain import Block

# Scheduling errors name the scheduling parameters (the flags come from the layers above).
BUDGET = "budget"


def is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


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
# Cost model
# ------------------------------------------------------------------------------------------------

MODEL = CostModel.from_model_shape()


@pytest.mark.parametrize("length", [1, 100, 4096, 131072])
def test_per_rank_cost_at_cp1_has_no_overhead(length):
    assert MODEL.overhead(length, 1) == 0.0
    assert MODEL.per_rank(length, 1) == MODEL.linear * length + MODEL.quadratic * length**2


@pytest.mark.parametrize("length", [1, 100, 4096, 131072])
def test_total_cost_grows_with_the_cp_size(length):
    totals = [MODEL.per_rank(length, c) * c for c in (1, 2, 4, 8, 16, 64)]
    assert MODEL.overhead(length, 1) == 0.0 and all(a < b for a, b in zip(totals, totals[1:]))
    eta = MODEL.cp_efficiency
    for c in (2, 4, 8, 6):
        work = MODEL.linear * length + MODEL.quadratic * length**2 / eta
        expected = work / c + MODEL.comm * length * (c - 1) / c
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


def test_group_cost_charges_the_ring_steps_once_per_non_empty_group():
    cost = CostModel(linear=2.0, quadratic=0.5, comm=3.0, ring_step=7.0, cp_efficiency=0.8)
    assert cost.group_cost([], 4) == 0.0
    assert cost.group_cost([10, 6], 1) == cost.per_rank(10, 1) + cost.per_rank(6, 1)
    work = (2.0 * 16 + 0.5 * (100 + 36) / 0.8) / 4
    assert cost.group_cost([10, 6], 4) == pytest.approx(work + 3.0 * 16 * 3 / 4 + 7.0 * 3)
    assert cost.group_cost([10, 6], 4) == pytest.approx(
        cost.per_rank(10, 4) + cost.per_rank(6, 4) + cost.ring_cost(4)
    )


def test_without_ring_step_and_efficiency_the_group_cost_is_the_per_sequence_sum():
    lengths = [1, 100, 4096]
    plain = replace(MODEL, ring_step=0.0, cp_efficiency=1.0)
    for c in (1, 2, 8):
        assert plain.group_cost(lengths, c) == pytest.approx(
            sum(plain.per_rank(n, c) for n in lengths), rel=1e-12
        )
        assert MODEL.group_cost(lengths, c) > plain.group_cost(lengths, c) or c == 1


@pytest.mark.parametrize(
    "coefficients",
    [(-1.0, 1.0, 0.0), (1.0, -1.0, 0.0), (1.0, 1.0, -1.0), (0.0, 0.0, 1.0), (1.0, 1.0, 0.0, -1.0)],
)
def test_cost_model_rejects_bad_coefficients(coefficients):
    with pytest.raises(ValueError, match="coefficients"):
        CostModel(*coefficients)


@pytest.mark.parametrize("efficiency", [0.0, -0.5, 1.5])
def test_cost_model_rejects_an_efficiency_outside_0_1(efficiency):
    with pytest.raises(ValueError, match="cp_efficiency"):
        CostModel(1.0, 1.0, cp_efficiency=efficiency)


def test_build_cost_model():
    assert build_cost_model("model") == replace(MODEL, name="model")
    assert build_cost_model("attention") == CostModel.attention_only()
    with pytest.raises(ValueError, match="cost_model='flops'"):
        build_cost_model("flops")
