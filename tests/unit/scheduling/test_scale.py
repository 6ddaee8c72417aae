"""Planning at scale: one length distribution, with the same tokens per rank (16 sequences per
rank, budget 8192, dp N/4 × cp 4), planned by ``default_dynamic_cp`` under the built-in "model"
cost model at N = 64, 1024 and 4096. The plan must not get much worse as the domain grows, and
no micro-batch may hold a CP group far larger than its sequences need.

What the planner does (lognormal lengths; CP/LB at N = 1024 or 4096 minus CP/LB at N = 64):
σ 0.5-0.8 stays within the 0.03 slack for medians 500-4000; heavier tails mostly do too since
the filling pass's miss limit grows with N (σ 1.0 / median 4000 +0.012, σ 1.5 / median 4000
+0.017), but not everywhere: σ 1.5 / median 2000 / seed 7 is +0.035 at N = 4096 (it was +0.082
with a fixed limit). The ratio test therefore draws σ in [0.5, 0.8] and keeps that heavy-tailed
case as an expected failure: it turns into an error once the planner holds there too. Planning
at N = 4096 takes 1-5 s, hence the few examples and no shrinking.
"""

import math
import random
from typing import Dict, List, Tuple

from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from scheduling_strategies import scaled

from megatron_dcp.scheduling import Plan, build_cost_model, build_scheduler
from megatron_dcp.scheduling.metrics import critical_path, lower_bound, rank_loads

BUDGET = 8192
PER_RANK = 16
CP = 4
SIZES = (64, 1024, 4096)
# Every sequence fits the smallest domain.
CAP = SIZES[0] * BUDGET
COST = build_cost_model("model")
# CP/LB at N = 1024 and 4096 may exceed CP/LB at N = 64 by this much.
RATIO_SLACK = 0.03
# The most groups of a plan that may be oversized (see oversized_fraction); the worst plan seen
# while choosing it had 1.1 % (a nearly empty last micro-batch with 760-token sequences on 16-32
# ranks), most had none.
OVERSIZED_LIMIT = 0.03


def scale_lengths(n: int, median: float, sigma: float, seed: int) -> List[int]:
    """16 × n lognormal lengths (the given median and σ), capped at CAP, at least 1 token."""
    rng = random.Random(seed)
    mu = math.log(median)
    return [max(1, min(CAP, round(rng.lognormvariate(mu, sigma)))) for _ in range(PER_RANK * n)]


def scale_plan(n: int, median: float, sigma: float, seed: int) -> Plan:
    """The plan of :func:`scale_lengths` (``schedule()`` validates it; checked again, cheaply)."""
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=n // CP,
        cp_size=CP,
        max_seqlen_per_dp_cp_rank=BUDGET,
        cost_model=COST,
    )
    return scheduler.schedule(scale_lengths(n, median, sigma, seed)).validate()


def ratio(plan: Plan) -> float:
    return critical_path(plan, COST) / lower_bound(plan, COST)


def oversized_fraction(plan: Plan) -> Tuple[float, Dict[int, int]]:
    """The fraction of the plan's groups that are far larger than their sequences need, and
    their count by size. A group of size s ≥ 4 is oversized when

    - its tokens fit a group a quarter of its size (≤ s/4 × budget), so its longest sequence's
      minimum CP size (``domain.cp_degree``) is at most s/4 and does not explain s; and
    - balance does not explain s either: on s/4 ranks its cost would stay at or under the
      micro-batch's most-loaded rank, so a smaller group would not slow the micro-batch down.
    """
    oversized: Dict[int, int] = {}
    total = 0
    for microbatch in plan.microbatches:
        top = max(rank_loads(plan, microbatch, COST))
        total += len(microbatch.groups)
        for group in microbatch.groups:
            quarter = group.size // 4
            lengths = [plan.seqlens[i] for i in group.sample_ids]
            if quarter < 1 or sum(lengths) > quarter * BUDGET:
                continue
            assert plan.domain.cp_degree(max(lengths, default=1)) <= quarter
            if COST.group_cost(lengths, quarter) <= top:
                oversized[group.size] = oversized.get(group.size, 0) + 1
    return sum(oversized.values()) / total, oversized


medians = st.integers(500, 4000)
seeds = st.integers(0, 2**16)
# No shrinking: every step would plan at N = 4096 again; the first failing example is reported.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)


@settings(max_examples=scaled(3), deadline=None, phases=PHASES)
@given(median=medians, sigma=st.floats(0.5, 0.8), seed=seeds)
@example(median=1000, sigma=0.8, seed=0)
@example(median=2000, sigma=1.5, seed=7).xfail(
    raises=AssertionError, reason="heavy tails: CP/LB at N = 4096 is +0.035 over N = 64"
)
def test_plan_quality_holds_as_the_domain_grows(median, sigma, seed):
    small = ratio(scale_plan(SIZES[0], median, sigma, seed))
    for n in SIZES[1:]:
        large = ratio(scale_plan(n, median, sigma, seed))
        assert large <= small + RATIO_SLACK, f"CP/LB {large:.4f} at N={n}, {small:.4f} at N=64"


@settings(max_examples=scaled(2), deadline=None, phases=PHASES)
@given(median=medians, sigma=st.floats(0.5, 1.5), seed=seeds)
@example(median=2000, sigma=0.8, seed=7)
def test_no_group_is_far_larger_than_its_sequences_need(median, sigma, seed):
    plan = scale_plan(SIZES[-1], median, sigma, seed)
    fraction, sizes = oversized_fraction(plan)
    assert fraction <= OVERSIZED_LIMIT, f"{fraction:.2%} of the groups are oversized: {sizes}"
