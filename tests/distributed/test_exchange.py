"""Length exchange and sample routing: each rank receives exactly its CP groups' samples, intact,
with one all-to-all; the lane all-gather (`--dcp-routing lane-all-gather`) yields the same samples
(more in test_routing.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.runtime.exchange import (
    GlobalLengths,
    all_gather_seqlens,
    collective_device,
    gather_lengths,
)
from megatron_dcp.runtime.routing import (
    SampleSchema,
    build_routing_table,
    route_by_lane_all_gather,
    route_samples,
)
from megatron_dcp.scheduling import CPGroup, Domain, MicroBatch, Plan, build_scheduler
from megatron_dcp.testing import run_distributed
from megatron_dcp.testing.plan_coverage import Layout, assert_covers, plan_of

SCHEMA = SampleSchema(
    (
        ("labels", torch.int64),
        ("loss_mask", torch.float32),
        ("position_ids", torch.int64),
        ("tokens", torch.int64),
    )
)


def make_sample(sample_id: int, length: int) -> dict[str, torch.Tensor]:
    """Contents that identify the sample, so a misrouted or garbled one cannot pass."""
    tokens = torch.arange(length, dtype=torch.int64) + 1000 * sample_id
    return {
        "tokens": tokens,
        "labels": tokens + 1,
        "loss_mask": torch.full((length,), 0.5 + sample_id, dtype=torch.float32),
        "position_ids": torch.arange(length, dtype=torch.int64),
    }


def dp_groups(dp_size: int, cp_size: int) -> list[Any]:
    """Megatron's DP groups over a domain equal to the world: one per CP rank."""
    return [dist.new_group([d * cp_size + c for d in range(dp_size)]) for c in range(cp_size)]


def split_counts(total: int, dp_size: int, seed: int) -> list[int]:
    """Random samples per DP rank (zeros allowed) summing to ``total``."""
    rng = random.Random(seed)
    cuts = sorted(rng.randint(0, total) for _ in range(dp_size - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


# ---------------------------------------------------------------------------------------------
# Lengths
# ---------------------------------------------------------------------------------------------


def _lengths_worker(rank: int, world_size: int, cp_size: int, counts: list[int]) -> list[int]:
    groups = dp_groups(world_size // cp_size, cp_size)
    dp_rank, cp_rank = divmod(rank, cp_size)
    local = [100 * dp_rank + k for k in range(counts[dp_rank])]
    return all_gather_seqlens(local, groups[cp_rank])


@pytest.mark.parametrize(
    "world_size, cp_size, counts",
    [(2, 1, [2, 1]), (4, 1, [3, 0, 1, 2]), (4, 2, [0, 2]), (8, 2, [1, 4, 0, 2]), (2, 1, [0, 0])],
)
def test_all_gather_seqlens_is_dp_rank_major(world_size, cp_size, counts):
    expected = [100 * d + k for d, count in enumerate(counts) for k in range(count)]
    assert run_distributed(_lengths_worker, world_size, cp_size, counts) == [expected] * world_size


def test_global_lengths_owner_and_ids():
    lengths = GlobalLengths(seqlens=(5, 6, 7, 8), counts=(2, 0, 2))
    assert [lengths.owner_of(i) for i in range(4)] == [0, 0, 2, 2]
    assert list(lengths.ids_of(1)) == [] and list(lengths.ids_of(2)) == [2, 3]
    with pytest.raises(ValueError, match="out of range"):
        lengths.owner_of(4)


# ---------------------------------------------------------------------------------------------
# Routing table (pure)
# ---------------------------------------------------------------------------------------------


def test_senders_spread_over_the_owners_cp_ranks():
    domain = Domain(dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=100)
    groups = (CPGroup((0, 1, 2, 3), (0, 1)),)
    plan = Plan((40, 40), domain, (MicroBatch(groups),)).validate()
    table = build_routing_table(plan, owner_of=lambda i: 0)  # DP rank 0 (positions 0, 1) has both
    sends = {(t.source, t.dest, t.sample_id) for t in table.transfers}
    assert len(sends) == 4 and {s for s, _, _ in sends} == {0, 1}
    assert sum(1 for s, _, _ in sends if s == 0) == 2  # two transfers each
    assert table.needed == ((0, 1),) * 4


# ---------------------------------------------------------------------------------------------
# Routing (distributed)
# ---------------------------------------------------------------------------------------------


def _plan_for(case: dict) -> Plan:
    if "plan" in case:
        return case["plan"]
    rng = random.Random(case["seed"])
    longest = case["dp"] * case["cp"] * case["budget"]
    seqlens = [
        min(longest, max(1, int(rng.lognormvariate(3.5, 1.0)))) for _ in range(case["num_samples"])
    ]
    scheduler = build_scheduler(
        "default_dynamic_cp",
        dp_size=case["dp"],
        cp_size=case["cp"],
        max_seqlen_per_dp_cp_rank=case["budget"],
        min_cp_size=case.get("min_cp", 1),
    )
    return scheduler.schedule(seqlens)


def _route_worker(rank: int, world_size: int, case: dict) -> dict:
    plan = _plan_for(case)
    lengths = GlobalLengths(plan.seqlens, tuple(case["counts"]))
    dp_rank, cp_rank = divmod(rank, plan.domain.cp_size)
    local = {i: make_sample(i, plan.seqlens[i]) for i in lengths.ids_of(dp_rank)}
    schema = None if case.get("infer_schema") else SCHEMA
    routed = route_samples(plan, local, rank, None, lengths.owner_of, schema=schema)
    groups = dp_groups(plan.domain.dp_size, plan.domain.cp_size)
    baseline = route_by_lane_all_gather(
        plan, local, rank, groups[cp_rank], lengths.owner_of, schema=SCHEMA
    )
    assert baseline.samples.keys() == routed.samples.keys()
    for i, sample in baseline.samples.items():
        assert all(torch.equal(sample[k], routed.samples[i][k]) for k in sample)
    return {"plan": plan, "routed": routed, "baseline_received": baseline.bytes_received}


def _my_sample_ids(plan: Plan, position: int) -> list[int]:
    return sorted(
        i
        for mb in plan.microbatches
        for g in mb.groups
        if position in g.ranks
        for i in g.sample_ids
    )


CASES = [
    pytest.param(dict(dp=2, cp=1, budget=64, num_samples=12, seed=1), 2, id="dp2"),
    pytest.param(dict(dp=2, cp=2, budget=64, num_samples=16, seed=2), 4, id="dp2-cp2"),
    pytest.param(dict(dp=4, cp=2, budget=64, num_samples=40, seed=3), 8, id="dp4-cp2"),
    pytest.param(
        dict(dp=2, cp=4, budget=48, num_samples=30, seed=4, min_cp=2), 8, id="dp2-cp4-min2"
    ),
    pytest.param(
        dict(dp=8, cp=1, budget=64, num_samples=3, seed=5, infer_schema=True),
        8,
        id="fewer-samples-than-ranks-infer-schema",
    ),
    pytest.param(dict(dp=4, cp=1, budget=64, num_samples=10, seed=6), 4, id="dp4"),
]


@pytest.mark.parametrize("case, world_size", CASES)
def test_each_rank_receives_exactly_its_groups_samples(case, world_size):
    dp = case["dp"]
    case = {**case, "counts": split_counts(case["num_samples"], dp, case["seed"])}
    results = run_distributed(_route_worker, world_size, case)
    plan = results[0]["plan"]
    layout = Layout(dp=dp, cp=case["cp"])
    assert_covers(plan_of(plan, layout), layout)  # groups of several sizes to route to
    for position, result in enumerate(results):
        routed = result["routed"]
        ids = _my_sample_ids(plan, position)
        assert list(routed.samples) == ids
        for i in ids:
            expected = make_sample(i, plan.seqlens[i])
            assert all(torch.equal(routed.samples[i][k], expected[k]) for k in expected)
        assert routed.bytes_needed == SCHEMA.bytes_per_token * sum(plan.seqlens[i] for i in ids)
        assert routed.bytes_received <= result["baseline_received"]
    assert sum(r["routed"].bytes_sent for r in results) == sum(
        r["routed"].bytes_received for r in results
    )
    _check_cp_siblings_agree(plan, [r["routed"] for r in results])


def _check_cp_siblings_agree(plan: Plan, routed: list) -> None:
    for microbatch in plan.microbatches:
        for group in microbatch.groups:
            first = routed[group.ranks[0]].samples
            for position in group.ranks[1:]:
                for i in group.sample_ids:
                    mine = routed[position].samples[i]
                    assert all(torch.equal(mine[k], first[i][k]) for k in mine)


def _bad_local_worker(rank: int, world_size: int) -> str:
    domain = Domain(dp_size=2, cp_size=1, max_seqlen_per_dp_cp_rank=100)
    plan = Plan((4, 4), domain, (MicroBatch((CPGroup((0,), (0,)), CPGroup((1,), (1,)))),))
    local = {rank: make_sample(rank, 3)}  # wrong length
    with pytest.raises(ValueError) as error:
        route_samples(plan, local, rank, None, lambda i: i, schema=SCHEMA)
    return str(error.value)


def test_malformed_samples_are_rejected():
    messages = run_distributed(_bad_local_worker, 2)
    assert all("expected (4,)" in m for m in messages)


def _devices(rank: int, world_size: int) -> tuple:
    return str(collective_device(None)), gather_lengths([rank + 1], None).seqlens


def test_collectives_run_on_the_cpu_under_gloo():
    """Under NCCL the lengths and samples travel on the rank's GPU; under gloo on the CPU."""
    results = run_distributed(_devices, 2, backend="gloo")
    assert results == [("cpu", (1, 2)), ("cpu", (1, 2))]


def _negative_length_worker(rank: int, world_size: int) -> str:
    local = [5, -3] if rank == 1 else [4, 7]
    with pytest.raises(ValueError) as error:
        gather_lengths(local, None)
    return str(error.value)


def test_a_negative_length_fails_every_rank_without_a_hang():
    """Only rank 1 holds the bad length; every rank must raise (not wait in the exchange)."""
    messages = run_distributed(_negative_length_worker, 3, timeout_s=30, collective_timeout_s=10)
    for rank, message in enumerate(messages):
        assert "DP ranks [1] hold negative lengths" in message
        assert ("[5, -3]" in message) == (rank == 1)
