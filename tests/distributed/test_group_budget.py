"""The communicator budget: ``communicator_budget``'s formula, and DCPGroups.create calling
``new_group`` (members only, ``use_local_synchronization=True``) exactly that many times per rank,
also after megatron's own groups; every rank creating every group instead when members-only
creation would hang (members holding different numbers of groups, a re-created group's name)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.runtime.groups import DCPGroups, communicator_budget, group_blocks
from megatron_dcp.scheduling import Domain
from megatron_dcp.testing import run_distributed


class _CountingNewGroup:
    """Stands in for ``dist.new_group`` while ``DCPGroups.create`` runs; records every call."""

    def __init__(self) -> None:
        self.real = dist.new_group
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def __call__(self, ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        local = bool(kwargs.get("use_local_synchronization", False))
        self.calls.append((tuple(ranks), local))
        return self.real(ranks, *args, **kwargs)


def _create_counting(create: Any) -> tuple[DCPGroups, list]:
    counter = _CountingNewGroup()
    dist.new_group = counter
    try:
        groups = create()
    finally:
        dist.new_group = counter.real
    return groups, counter.calls


def _check_groups(groups: DCPGroups) -> dict[int, float]:
    """All-reduce the position over each group this rank holds (sizes ≥ 2)."""
    sums = {}
    for size in groups.sizes:
        if size == 1 or groups.position // size * size + size > groups.domain_size > size:
            continue  # no communicator, or no block of this size at this position
        value = torch.tensor([float(groups.position)])
        dist.all_reduce(value, group=groups.group(size))
        sums[size] = value.item()
    return sums


def _count_worker(rank: int, world_size: int, lists: list, min_cp_size: int, skew: bool) -> dict:
    if skew:
        dist.new_group([0])  # every rank calls it, only rank 0 joins: rank 0 holds one more group
    groups, calls = _create_counting(lambda: DCPGroups.create(lists, min_cp_size))
    result = {
        "position": groups.position,
        "calls": calls,
        "count": groups.communicator_count(),
        "sums": _check_groups(groups),
    }
    groups.destroy()
    return result


COUNT_LAYOUTS = [
    pytest.param(8, [list(range(8))], 1, id="N8-min1"),
    pytest.param(8, [list(range(8))], 2, id="N8-min2"),
    pytest.param(8, [list(range(8))], 4, id="N8-min4"),
    pytest.param(6, [list(range(6))], 1, id="N6-min1"),
    pytest.param(6, [list(range(6))], 2, id="N6-min2"),
    pytest.param(7, [list(range(7))], 1, id="N7-min1"),
    pytest.param(8, [[0, 2, 4, 6], [1, 3, 5, 7]], 1, id="world8-two-domains-of-4"),
    pytest.param(8, [[0, 1, 2, 3], [4, 5, 6, 7]], 2, id="world8-two-domains-of-4-min2"),
]


@pytest.mark.parametrize("world_size, lists, min_cp_size", COUNT_LAYOUTS)
def test_each_rank_creates_only_the_groups_it_joins(world_size, lists, min_cp_size):
    results = run_distributed(_count_worker, world_size, lists, min_cp_size, False, timeout_s=60)
    n = len(lists[0])
    for rank, result in enumerate(results):
        budget = communicator_budget(n, min_cp_size, result["position"])
        assert len(result["calls"]) == budget.new_group_calls, result["calls"]
        assert all(rank in ranks and local for ranks, local in result["calls"])
        assert (result["count"].created, result["count"].reused) == (budget.joined, 0)
        mine = next(r for r in lists if rank in r)
        for size, got in result["sums"].items():
            start = 0 if size == n else result["position"] // size * size
            assert got == float(sum(range(start, start + size))), (rank, size)
        assert [len(ranks) for ranks, _ in result["calls"]] == sorted(result["sums"], reverse=True)
        assert all(set(ranks) <= set(mine) for ranks, _ in result["calls"])


@pytest.mark.parametrize("world_size, lists, min_cp_size", COUNT_LAYOUTS[:1] + COUNT_LAYOUTS[3:4])
def test_unequal_group_counts_fall_back_to_every_rank_creating_every_group(
    world_size, lists, min_cp_size
):
    """Rank 0 holds one group more than its peers: torch would name the groups it creates
    members-only differently from its peers' names (a hang), so every rank creates every group."""
    results = run_distributed(_count_worker, world_size, lists, min_cp_size, True, timeout_s=60)
    n = len(lists[0])
    for result in results:
        budget = communicator_budget(n, min_cp_size, result["position"])
        assert len(result["calls"]) == budget.blocks * len(lists)
        assert not any(local for _, local in result["calls"])
        assert result["count"].created == budget.joined
        for size, got in result["sums"].items():
            start = 0 if size == n else result["position"] // size * size
            assert got == float(sum(range(start, start + size)))


def _recreate_worker(rank: int, world_size: int) -> list:
    """create → destroy → create: the second registry's groups would get the first one's names
    (torch's name counts the groups held, back to where it was), so it must not go members-only."""
    rounds = []
    for _ in range(3):
        groups, calls = _create_counting(lambda: DCPGroups.create([list(range(world_size))], 1))
        rounds.append((len(calls), all(local for _, local in calls), _check_groups(groups)))
        groups.destroy()
    return rounds


def test_recreating_after_destroy_does_not_reuse_a_name():
    results = run_distributed(_recreate_worker, 6, timeout_s=60)
    for rank, rounds in enumerate(results):
        budget = communicator_budget(6, 1, rank)
        assert [calls for calls, _, _ in rounds] == [budget.new_group_calls] + [budget.blocks] * 2
        assert [local for _, local, _ in rounds] == [True, False, False]
        assert all(sums == rounds[0][2] for _, _, sums in rounds)


def _megatron_worker(rank: int, world_size: int, pp: int, cp: int) -> dict:
    from megatron_dcp.integration.process_groups import create_dcp_groups
    from megatron_dcp.testing.gpt import init_megatron

    init_megatron(pp=pp, cp=cp)
    groups, calls = _create_counting(create_dcp_groups)
    result = {
        "position": groups.position,
        "domain_size": groups.domain_size,
        "calls": calls,
        "count": groups.communicator_count(),
        "sums": _check_groups(groups),
    }
    groups.destroy()
    return result


@pytest.mark.parametrize("pp, cp", [(2, 1), (1, 2)], ids=["pp2", "cp2"])
def test_members_only_after_megatron_groups(pp, cp):
    """After megatron's own groups (made the ordinary way: every rank calls new_group for each),
    DCP still creates members-only; megatron's DP×CP and CP groups are reused."""
    if not import_megatron_core():
        pytest.skip("megatron-core not installed")
    import megatron_dcp.testing.gpt  # noqa: F401  (imported before the fork, once)

    results = run_distributed(_megatron_worker, 8, pp, cp, timeout_s=120)
    for result in results:
        n = result["domain_size"]
        budget = communicator_budget(n, 1, result["position"])
        reused = 1 + (cp > 1)  # the DP×CP group, and megatron's static CP group when cp > 1
        assert all(local for _, local in result["calls"])
        assert len(result["calls"]) == budget.new_group_calls - reused
        assert (result["count"].created, result["count"].reused) == (budget.joined - reused, reused)
        assert set(result["sums"]) == {s for s in (2, 4, 8) if s <= n}


def test_budget_formula_at_scale():
    assert communicator_budget(4096, 1) == (12, 12, 4095)
    assert communicator_budget(4096, 2) == (12, 12, 4095)
    assert communicator_budget(4096, 8) == (10, 10, 1023)
    assert communicator_budget(16384, 1) == (14, 14, 16383)
    assert communicator_budget(16384, 16) == (11, 11, 2047)
    assert communicator_budget(8, 1) == (3, 3, 7)
    assert communicator_budget(6, 1) == (3, 3, 5)  # blocks [0,2) [2,4) [4,6) [0,4) [0,6)
    assert communicator_budget(6, 1, position=5).joined == 2  # no block of 4 holds position 5
    assert communicator_budget(4096, 1, position=4095).joined == 12


def test_budget_formula_matches_the_group_set():
    """Every N up to 40 and every min CP size: joined per position and the block count are those
    of the scheduling layer's group set (``group_blocks``)."""
    for n in range(1, 41):
        for m in (1 << k for k in range(n.bit_length())):
            blocks = group_blocks(
                Domain(dp_size=n, cp_size=1, max_seqlen_per_dp_cp_rank=1, min_cp_size=m)
            )
            joined = [sum(b.start <= p < b.stop for b in blocks) for p in range(n)]
            assert communicator_budget(n, m).blocks == len(blocks), (n, m)
            assert communicator_budget(n, m).joined == max(joined), (n, m)
            for p in range(n):
                assert communicator_budget(n, m, p).joined == joined[p], (n, m, p)


@pytest.mark.parametrize("n, m, position", [(8, 3, None), (8, 16, None), (8, 1, 8), (8, 0, None)])
def test_budget_rejects_bad_arguments(n, m, position):
    with pytest.raises(ValueError):
        communicator_budget(n, m, position)
