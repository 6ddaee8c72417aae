"""Hypothesis strategies and helpers shared by the property tests of the schedulers
(``test_properties_*.py``) and the draft tests (``rank_drafts``: draft micro-batches): domains of
any size N = dp·cp in 1..64 (odd and non-powers of two included), power-of-two minimum CP
sizes, VPP group sizes None or 1..4, budgets 1..4096, and lengths mixing tiny, typical and
near-maximal (N·budget) sequences."""

import math
from typing import Optional

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st

from megatron_dcp.scheduling import CostModel, Plan, build_scheduler
from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import Item, group_of_items
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.topology import NodeLayout
from megatron_dcp.tools.fuzz_cases import FuzzCase
from megatron_dcp.tools.plan_check import MUST_REJECT, rejection

# Scheduling errors name the scheduling parameters (the flags come from the layers above).
BUDGET, MIN_CP, VPP = "budget", "min_cp_size", "microbatch_group_size_per_vp_stage"

NAMES = ("default_dynamic_cp", "dp_balanced")
INTERESTING_N = (1, 2, 3, 5, 6, 7, 8, 12, 24, 48, 63, 64)


def scaled(examples: int) -> int:
    """``examples`` under the ``ci`` profile, more under ``dev`` (see tests/conftest.py)."""
    return max(1, examples * settings().max_examples // 100)


def is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def allowed_block(start: int, size: int, n: int, min_cp: int) -> bool:
    """A CP group exists for ``[start, start + size)``."""
    whole = start == 0 and size == n
    return whole or (is_pow2(size) and size >= min_cp and start % size == 0 and start + size <= n)


# ------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------


@st.composite
def layouts(draw, static_cp: bool = False):
    """(dp, cp, budget, min_cp, vpp); with ``static_cp`` cp is a size dp_balanced accepts."""
    n = draw(st.one_of(st.integers(1, 64), st.sampled_from(INTERESTING_N)))
    min_cp = draw(st.sampled_from([1 << k for k in range(n.bit_length())]))
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    if static_cp:
        divisors = [d for d in divisors if d == n or (is_pow2(d) and d >= min_cp)]
    cp = draw(st.sampled_from(divisors))
    vpp = draw(st.one_of(st.none(), st.integers(1, 4)))
    budget = draw(st.one_of(st.integers(1, 4096), st.sampled_from([1, 2, 3, 7, 4096])))
    return n // cp, cp, budget, min_cp, vpp


def cost_models(spill: bool = False, nodes: bool = False):
    """Cost models from compute-bound to overhead-bound (ring steps, fixed micro-batch cost, a
    fixed cost per sequence, CP efficiency); with ``spill``, score spill too (a cost that falls as c grows), with ``nodes``
    node tiers (1, 2 or 4 ranks per node, dearer K/V exchange and ring steps across them)."""
    return st.builds(
        CostModel,
        linear=st.floats(0.1, 10.0),
        quadratic=st.floats(0.0, 1.0),
        comm=st.floats(0.0, 5.0),
        ring_step=st.floats(0.0, 500.0),
        microbatch=st.floats(0.0, 1000.0),
        cp_efficiency=st.floats(0.3, 1.0),
        sequence=st.sampled_from([0.0, 0.5, 40.0]),
        spill=st.sampled_from([0.0, 0.5]) if spill else st.just(0.0),
        spill_elements=st.sampled_from([math.inf, 1e4]) if spill else st.just(math.inf),
        nodes=st.one_of(st.none(), node_layouts()) if nodes else st.none(),
    )


def node_layouts():
    return st.builds(NodeLayout, st.sampled_from([1, 2, 4]), st.floats(1, 10), st.floats(1, 4))


def lengths(cap: int, budget: int, min_size: int = 0, max_size: int = 24):
    """Lists of tiny, typical (≤ budget), any (≤ cap) and near-maximal (cap − 2 .. cap)
    lengths."""
    one = st.one_of(
        st.integers(0, 3),
        st.integers(1, budget),
        st.integers(0, cap),
        st.integers(max(0, cap - 2), cap),
    )
    return st.lists(one, min_size=min_size, max_size=max_size)


@st.composite
def cases(draw, name: str, max_size: int = 40) -> FuzzCase:
    """A valid input for ``name``: lengths fit the largest group the scheduler can use. For
    dp_balanced, often enough samples to give every DP rank one per micro-batch."""
    dp, cp, budget, min_cp, vpp = draw(layouts(static_cp=name == "dp_balanced"))
    cap = (cp if name == "dp_balanced" else dp * cp) * budget
    min_size = 0
    if name == "dp_balanced" and draw(st.booleans()):
        min_size = dp * (vpp or 1)
    seqlens = draw(lengths(cap, budget, min_size, min_size + max_size))
    return FuzzCase(dp, cp, budget, min_cp, vpp, tuple(seqlens))


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def plan_or_none(name: str, case: FuzzCase) -> Optional[Plan]:
    """The plan; None when the input is legitimately rejected."""
    expected = rejection(name, case)
    try:
        plan = build_scheduler(name, **case.kwargs()).schedule(list(case.seqlens))
    except ValueError as error:
        assert isinstance(error, SchedulingError), f"{name}: not a SchedulingError: {error}"
        assert expected is not None, f"{name} rejected an input that has a plan: {error}"
        event("rejected (allowed)")
        return None
    assert expected != MUST_REJECT, f"{name} accepted an input that has no plan"
    event("planned")
    return plan


def schedule_kwargs(**overrides):
    kwargs = dict(dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=8)
    kwargs.update(overrides)
    return kwargs


parametrize_names = pytest.mark.parametrize("name", NAMES)


def rank_drafts(ctx, layout):
    """Draft micro-batches of one-rank groups (for the steps that work on a plan's drafts) from
    [[lengths of group 0], [lengths of group 1], ...] per micro-batch; sample ids in order of
    appearance."""
    drafts, ids = [], iter(range(1000))
    for groups in layout:
        draft = []
        for start, lengths in enumerate(groups):
            items = [Item(next(ids), length, 1) for length in lengths]
            draft.append(group_of_items(Block(start, 1), items, ctx.cost))
        drafts.append(draft)
    return drafts
