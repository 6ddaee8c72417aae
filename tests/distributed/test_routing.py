"""The two routing methods (``--dcp-routing``): the all-to-all over the DP×CP domain and the
all-gather inside each CP lane give every rank exactly the samples of its CP groups, bit for bit
the same; what they move equals ``runtime.routing_volume``'s figures; and, as a property over
random plans, every sample reaches exactly the ranks of its group under both."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dcp.runtime.exchange import GlobalLengths
from megatron_dcp.runtime.routing import (
    SampleSchema,
    build_routing_table,
    lane_positions,
    needed_samples,
    route_by_lane_all_gather,
    route_samples,
)
from megatron_dcp.runtime.routing_volume import all_to_all_volume, lane_all_gather_volume
from megatron_dcp.scheduling import Plan, build_scheduler
from megatron_dcp.testing import run_distributed
from megatron_dcp.testing.plan_coverage import Layout, assert_covers, plan_of

SCHEMA = SampleSchema(
    (("labels", torch.int64), ("loss_mask", torch.float32), ("tokens", torch.int64))
)


def make_sample(sample_id: int, length: int) -> dict[str, torch.Tensor]:
    """Random contents seeded by the id: a misrouted or garbled sample cannot pass."""
    generator = torch.Generator().manual_seed(1000 + sample_id)
    tokens = torch.randint(0, 1 << 40, (length,), generator=generator)
    return {
        "tokens": tokens,
        "labels": tokens.roll(-1),
        "loss_mask": torch.rand(length, generator=generator),
    }


def random_plan(dp: int, cp: int, seed: int, min_cp: int = 1) -> tuple[Plan, tuple[int, ...]]:
    """A default_dynamic_cp plan of lognormal lengths (CP sizes mixed, some groups spanning
    replicas) and random samples-per-DP-rank counts, zeros allowed."""
    rng = random.Random(seed)
    budget = 48
    count = rng.randint(dp * cp, 6 * dp * cp)
    seqlens = [
        min(dp * cp * budget, max(1, int(rng.lognormvariate(3.3, 1.1)))) for _ in range(count)
    ]
    cuts = sorted(rng.randint(0, count) for _ in range(dp - 1))
    counts = tuple(b - a for a, b in zip([0, *cuts], [*cuts, count]))
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=dp,
        cp_size=cp,
        max_seqlen_per_dp_cp_rank=budget,
        min_cp_size=min_cp,
    )
    return scheduler.schedule(seqlens), counts


def _both_routings_worker(rank: int, world_size: int, dp: int, cp: int, seeds: list) -> list:
    """Route several random batches both ways on this rank; compare here, report figures."""
    dp_rank, cp_rank = divmod(rank, cp)
    lanes = [dist.new_group(list(range(c, world_size, cp))) for c in range(cp)]
    reports = []
    for seed in seeds:
        plan, counts = random_plan(dp, cp, seed)
        lengths = GlobalLengths(plan.seqlens, counts)
        local = {i: make_sample(i, plan.seqlens[i]) for i in lengths.ids_of(dp_rank)}
        a2a = route_samples(plan, local, rank, None, lengths.owner_of, schema=SCHEMA)
        lane = route_by_lane_all_gather(plan, local, rank, lanes[cp_rank], lengths.owner_of)
        assert list(a2a.samples) == list(lane.samples) == list(needed_samples(plan)[rank])
        for i, sample in a2a.samples.items():
            for key, tensor in sample.items():
                other = lane.samples[i][key]
                assert tensor.dtype == other.dtype and torch.equal(tensor, other), (seed, i, key)
                assert torch.equal(tensor, make_sample(i, plan.seqlens[i])[key])
        reports.append((seed, a2a.bytes_received, a2a.bytes_sent, lane.bytes_received))
    return reports


@pytest.mark.parametrize(
    "dp, cp",
    [(2, 2), (4, 1), (4, 2), (2, 4)],
    ids=["world4-dp2-cp2", "world4-dp4-cp1", "world8-dp4-cp2", "world8-dp2-cp4"],
)
def test_both_routings_give_each_rank_exactly_its_groups_samples_bit_identical(dp, cp):
    seeds = [10 * dp + cp + k for k in range(4)]
    results = run_distributed(_both_routings_worker, dp * cp, dp, cp, seeds, timeout_s=300)
    for index, seed in enumerate(seeds):
        plan, counts = random_plan(dp, cp, seed)
        assert_covers(plan_of(plan, Layout(dp=dp, cp=cp)), Layout(dp=dp, cp=cp))
        owner_of = GlobalLengths(plan.seqlens, counts).owner_of
        a2a = all_to_all_volume(plan, owner_of, SCHEMA.bytes_per_token)
        lane = lane_all_gather_volume(plan, owner_of, SCHEMA.bytes_per_token)
        for position, reports in enumerate(results):
            _, a2a_received, a2a_sent, lane_received = reports[index]
            assert a2a_received == a2a[position].bytes_received
            assert a2a_sent == a2a[position].bytes_sent
            assert lane_received == lane[position].bytes_received


def _wrong_lane_worker(rank: int, world_size: int) -> str:
    plan, counts = random_plan(2, 2, seed=3)
    lengths = GlobalLengths(plan.seqlens, counts)
    local = {i: make_sample(i, plan.seqlens[i]) for i in lengths.ids_of(rank // 2)}
    with pytest.raises(ValueError) as error:  # the DP×CP group (the world) is not a lane
        route_by_lane_all_gather(plan, local, rank, None, lengths.owner_of, schema=SCHEMA)
    return str(error.value)


def test_a_group_that_is_not_the_lane_is_refused():
    for message in run_distributed(_wrong_lane_worker, 4):
        assert "megatron's DP group" in message


# ---------------------------------------------------------------------------------------------
# Properties over random plans (no communication): where each sample ends up
# ---------------------------------------------------------------------------------------------


def holders_after_all_to_all(plan: Plan, owner_of) -> dict[int, set[int]]:
    """Sample id -> positions that hold it after the all-to-all and keep it: the positions that
    received it, plus those of its owner's replica that need it (they keep their own copy)."""
    table = build_routing_table(plan, owner_of)
    needed = needed_samples(plan)
    held = {i: set() for i in range(len(plan.seqlens))}
    for transfer in table.transfers:
        assert transfer.source // plan.domain.cp_size == owner_of(transfer.sample_id)  # holds it
        held[transfer.sample_id].add(transfer.dest)
    for position, ids in enumerate(needed):
        for i in ids:
            if position // plan.domain.cp_size == owner_of(i):
                held[i].add(position)
    return held


def holders_after_lane_all_gather(plan: Plan, owner_of) -> dict[int, set[int]]:
    """Sample id -> positions that hold it after the lane all-gather: each lane gathers one copy
    of every replica's samples (the owner's position in that lane sent it), and a position
    keeps what its groups need."""
    cp_size = plan.domain.cp_size
    needed = needed_samples(plan)
    held = {i: set() for i in range(len(plan.seqlens))}
    for position in range(plan.domain.size):
        lane = lane_positions(plan, position)
        senders = {i: owner_of(i) * cp_size + position % cp_size for i in held}
        gathered = {i for i, sender in senders.items() if sender in lane}
        for i in gathered & set(needed[position]):
            held[i].add(position)
    return held


@settings(max_examples=60)
@given(
    dp=st.sampled_from([1, 2, 3, 4, 8]),
    cp=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 10**6),
)
def test_every_sample_reaches_exactly_its_groups_ranks_under_both_routings(dp, cp, seed):
    plan, counts = random_plan(dp, cp, seed)
    owner_of = GlobalLengths(plan.seqlens, counts).owner_of
    group_ranks = {
        i: set(group.ranks)
        for microbatch in plan.microbatches
        for group in microbatch.groups
        for i in group.sample_ids
    }
    assert holders_after_all_to_all(plan, owner_of) == group_ranks
    assert holders_after_lane_all_gather(plan, owner_of) == group_ranks
    for position in range(plan.domain.size):
        lane = lane_positions(plan, position)
        assert position in lane and len(lane) == dp  # one rank of every replica
        assert {p % cp for p in lane} == {position % cp}


@settings(max_examples=60)
@given(dp=st.sampled_from([1, 2, 4, 8]), cp=st.sampled_from([1, 2, 4]), seed=st.integers(0, 10**6))
def test_volumes_bytes_balance_and_peers_stay_where_each_method_allows(dp, cp, seed):
    """Bytes sent equal bytes received over the domain; the all-to-all receives no more than
    the lane all-gather; its peers are any ranks, the lane's only its ring neighbours."""
    plan, counts = random_plan(dp, cp, seed)
    owner_of = GlobalLengths(plan.seqlens, counts).owner_of
    a2a = all_to_all_volume(plan, owner_of, SCHEMA.bytes_per_token)
    lane = lane_all_gather_volume(plan, owner_of, SCHEMA.bytes_per_token)
    assert sum(v.bytes_sent for v in a2a) == sum(v.bytes_received for v in a2a)
    for mine, gathered in zip(a2a, lane):
        assert mine.bytes_received <= gathered.bytes_received
        assert mine.sources <= mine.peers and mine.position not in mine.peers
        assert gathered.peers <= set(lane_positions(plan, gathered.position))
        assert len(gathered.peers) == min(2, dp - 1)
        assert len(gathered.sources) == dp - 1
