"""``default_dynamic_cp`` under the ring term and the per-micro-batch cost: groups carry their ring
steps, short sequences stay on small groups when the ring is expensive, light tail micro-batches
are dissolved into the others, and VPP alignment keeps the better of its candidate plans."""

from dataclasses import replace

import pytest

from megatron_dcp.scheduling import CostModel, Domain, build_scheduler
from megatron_dcp.scheduling.draft import GroupDraft, Item
from megatron_dcp.scheduling.dynamic_cp.moves.dissolve import dissolve_light_microbatches
from megatron_dcp.scheduling.dynamic_cp.search_state import Context
from megatron_dcp.scheduling.metrics import critical_path, lower_bound

MODEL = CostModel.from_model_shape()


def context(n: int, budget: int, cost: CostModel) -> Context:
    return Context(Domain(n, 1, budget), cost)


def row_of(ctx: Context, layout) -> list:
    """A micro-batch from [(start, size, [lengths])]; sample ids from the lengths' order."""
    draft = []
    for start, size, lengths in layout:
        group = ctx.group(ctx.domain.root() if size == ctx.domain.size else _block(start, size))
        for length in lengths:
            group.push(
                Item(len(_IDS), length, ctx.domain.cp_degree(length)), ctx.load(length, size)
            )
            _IDS.append(length)
        draft.append(group)
    return draft


_IDS: list = []


def _block(start, size):
    from megatron_dcp.scheduling.domain import Block

    return Block(start, size)


def test_a_group_carries_its_ring_steps_from_its_first_sample():
    cost = CostModel(1.0, 0.0, ring_step=10.0)
    ctx = context(4, 100, cost)
    group = ctx.group(ctx.domain.root())
    assert group.load == 0.0
    group.push(Item(0, 8, 1), ctx.load(8, 4))
    assert group.load == pytest.approx(2.0 + 30.0) == pytest.approx(cost.group_cost([8], 4))
    group.push(Item(1, 4, 1), ctx.load(4, 4))
    assert group.load == pytest.approx(cost.group_cost([8, 4], 4))
    group.pop(group.items[0], ctx.load(8, 4))
    group.pop(group.items[0], ctx.load(4, 4))
    assert group.load == 0.0 and ctx.alone(4, 4) == pytest.approx(1.0 + 30.0)


def test_an_expensive_ring_keeps_short_sequences_off_large_groups():
    lengths = [700, 600, 500] + [40] * 40
    kwargs = dict(dp_size=8, cp_size=1, max_seqlen_per_dp_cp_rank=1000)
    cheap = build_scheduler("default_dynamic_cp", cost_model=MODEL, **kwargs).schedule(lengths)
    costly = replace(MODEL, ring_step=500 * MODEL.linear)
    plan = build_scheduler("default_dynamic_cp", cost_model=costly, **kwargs).schedule(lengths)
    assert max(plan.cp_size_histogram()) == 1  # every sequence fits one rank: no ring at all
    assert critical_path(plan, costly) <= critical_path(cheap, costly)


def test_a_light_tail_microbatch_is_dissolved_when_that_pays():
    cost = CostModel(1.0, 0.0, ring_step=50.0, microbatch=5.0)
    ctx = context(2, 100, cost)
    _IDS.clear()
    drafts = [
        row_of(ctx, [(0, 1, [60]), (1, 1, [60])]),
        row_of(ctx, [(0, 1, [60]), (1, 1, [60])]),
        row_of(ctx, [(0, 2, [10])]),  # 10 tokens on a ring of 2: load 5 + 50
    ]
    before = sum(max(g.load for g in draft) for draft in drafts)
    dissolve_light_microbatches(ctx, drafts)
    assert len(drafts) == 2 and sorted(len(g.items) for r in drafts for g in r) == [1, 1, 1, 2]
    assert sum(max(g.load for g in draft) for draft in drafts) + 5.0 * 2 < before + 5.0 * 3


def test_a_microbatch_is_kept_when_its_samples_do_not_fit_elsewhere():
    cost = CostModel(1.0, 0.0, microbatch=5.0)
    ctx = context(2, 100, cost)
    _IDS.clear()
    drafts = [row_of(ctx, [(0, 1, [95]), (1, 1, [95])]), row_of(ctx, [(0, 1, [10]), (1, 1, [10])])]
    dissolve_light_microbatches(ctx, drafts)
    assert len(drafts) == 2 and [len(g.items) for g in drafts[1]] == [1, 1]
    assert [g.load for g in drafts[0]] == [95.0, 95.0]  # the failed attempt was undone


def test_dissolving_keeps_a_micro_batch_count_vpp_accepts():
    cost = CostModel(1.0, 0.0, microbatch=50.0)
    ctx = context(2, 100, cost)
    _IDS.clear()
    drafts = [row_of(ctx, [(0, 1, [40]), (1, 1, [40])]) for _ in range(3)]
    drafts.append(row_of(ctx, [(0, 1, [5]), (1, 1, [5])]))
    dissolve_light_microbatches(ctx, drafts, vpp=2)
    assert len(drafts) % 2 == 0


@pytest.mark.parametrize("vpp", [2, 3, 4])
def test_vpp_plans_stay_valid_and_above_the_bound(vpp):
    lengths = [900, 700, 650, 300] + [50 + 7 * i for i in range(60)]
    cost = replace(MODEL, ring_step=64 * MODEL.linear, microbatch=14 * MODEL.linear)
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=4,
        cp_size=2,
        max_seqlen_per_dp_cp_rank=512,
        microbatch_group_size_per_vp_stage=vpp,
        cost_model=cost,
    )
    plan = scheduler.schedule(lengths).validate()
    assert plan.num_microbatches % vpp == 0
    assert lower_bound(plan, cost) <= critical_path(plan, cost)


def test_group_draft_over_uses_the_cost_models_ring():
    cost = CostModel(1.0, 0.0, ring_step=3.0)
    block = _block(0, 4)
    assert GroupDraft.over(block, cost).ring == cost.ring_cost(4) == 9.0


def test_no_group_is_left_with_empty_samples_only():
    """Empty (0-token) samples join groups with work: a group of empty samples alone would leave
    its ranks idle in all but name (the RL adapter's fewer-samples-than-ranks case, and random
    batches with many empty samples on power-of-two domains)."""
    import random

    rng = random.Random(0)
    cases = [([10, 0, 6], 2, 4, 64)]
    for _ in range(200):
        n = rng.choice([2, 4, 8, 16])
        budget = rng.choice([8, 64, 512])
        lengths = [
            rng.choice([0, 0, rng.randint(1, n * budget)]) for _ in range(rng.randint(1, 40))
        ]
        cases.append((lengths, n, 1, budget))
    for lengths, dp, cp, budget in cases:
        plan = build_scheduler(
            "default_dynamic_cp", dp_size=dp, cp_size=cp, max_seqlen_per_dp_cp_rank=budget
        ).schedule(lengths)
        for microbatch in plan.microbatches:
            if any(lengths[i] for i in microbatch.sample_ids):
                for group in microbatch.groups:
                    assert any(lengths[i] for i in group.sample_ids), (lengths, dp, cp, budget)
