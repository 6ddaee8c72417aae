"""DCPGroups: one communicator per aligned block, membership proven by all-reduce, reuse of
existing groups agreed by every member, rank lists learnt from a group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.runtime.groups import DCPGroups, domain_rank_lists_from
from megatron_dcp.scheduling import CPGroup
from megatron_dcp.testing import run_distributed


def _block_start(position: int, size: int, domain_size: int) -> int:
    return 0 if size == domain_size else position // size * size


def _sum_positions_per_size(groups: DCPGroups) -> dict[int, Any]:
    """All-reduce the position over this rank's group of each size (None: no block)."""
    sums: dict[int, Any] = {}
    for size in groups.sizes:
        try:
            group = groups.group(size)
        except ValueError:
            sums[size] = None
            continue
        value = torch.tensor([float(groups.position)])
        if group is not None:
            dist.all_reduce(value, group=group)
        sums[size] = (value.item(), groups.ranks(size))
    return sums


def _create_and_reduce(rank: int, world_size: int, lists: list, min_cp_size: int) -> dict:
    groups = DCPGroups.create(lists, min_cp_size)
    result = {
        "position": groups.position,
        "sizes": groups.sizes,
        "sums": _sum_positions_per_size(groups),
        "count": groups.communicator_count(),
        "report": groups.report(),
    }
    groups.destroy()
    groups.destroy()  # idempotent
    return result


LAYOUTS = [
    pytest.param(2, [[0, 1]], 1, id="world2"),
    pytest.param(4, [[0, 1, 2, 3]], 1, id="world4"),
    pytest.param(4, [[0, 1], [2, 3]], 1, id="world4-domain2"),
    pytest.param(8, [list(range(8))], 1, id="world8"),
    pytest.param(8, [list(range(8))], 2, id="world8-min2"),
    pytest.param(8, [[0, 2, 4, 6], [1, 3, 5, 7]], 1, id="world8-tp2-domain4"),
    pytest.param(8, [[0, 1, 4, 5], [2, 3, 6, 7]], 2, id="world8-pp2-domain4-min2"),
    pytest.param(6, [list(range(6))], 1, id="world6-non-power-of-two"),
]


@pytest.mark.parametrize("world_size, lists, min_cp_size", LAYOUTS)
def test_every_block_has_a_group_with_exactly_its_members(world_size, lists, min_cp_size):
    results = run_distributed(_create_and_reduce, world_size, lists, min_cp_size)
    n = len(lists[0])
    for rank, result in enumerate(results):
        ranks = next(r for r in lists if rank in r)
        position = ranks.index(rank)
        assert result["position"] == position
        assert result["sizes"] == _expected_sizes(n, min_cp_size)
        for size, got in result["sums"].items():
            start = _block_start(position, size, n)
            if start + size > n:
                assert got is None  # e.g. positions 4, 5 of a domain of 6 have no block of 4
                continue
            block = range(start, start + size)
            assert got == (float(sum(block)), tuple(ranks[p] for p in block))
        held = sum(1 for got in result["sums"].values() if got and len(got[1]) > 1)
        assert (result["count"].created, result["count"].reused) == (held, 0)
        assert f"position {position}" in result["report"]


def _expected_sizes(n: int, min_cp_size: int) -> tuple[int, ...]:
    sizes = {s for s in (1, 2, 4, 8) if min_cp_size <= s <= n} | {n}
    return tuple(sorted(sizes))


def _reuse_worker(rank: int, world_size: int, offer_all: bool) -> dict:
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = cp_groups[rank // 2]
    reuse: dict = {(0, 1, 2, 3): dist.group.WORLD}
    if offer_all or rank == 0:  # only rank 0 offering: its peer has nothing to reuse
        reuse[(rank // 2 * 2, rank // 2 * 2 + 1)] = mine
    groups = DCPGroups.create([[0, 1, 2, 3]], 1, reuse=reuse)
    sums = _sum_positions_per_size(groups)
    result = {
        "count": groups.communicator_count(),
        "cp_reused": groups.group(2) is mine,
        "world_reused": groups.group(4) is dist.group.WORLD,
        "sums": {size: got[0] for size, got in sums.items()},
    }
    groups.destroy()
    return result


@pytest.mark.parametrize("offer_all", [True, False])
def test_reuse_needs_every_member_to_offer(offer_all):
    results = run_distributed(_reuse_worker, 4, offer_all)
    for rank, result in enumerate(results):
        assert result["world_reused"]
        assert result["cp_reused"] == offer_all
        reused = 2 if offer_all else 1
        assert (result["count"].created, result["count"].reused) == (2 - reused, reused)
        assert result["sums"] == {1: rank, 2: float(1 if rank < 2 else 5), 4: 6.0}


def _lists_from_group_worker(rank: int, world_size: int) -> dict:
    tp_peers = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]
    lists = domain_rank_lists_from(tp_peers[rank % 2])
    groups = DCPGroups.create(lists, 2, reuse={tuple(lists[rank % 2]): tp_peers[rank % 2]})
    value = torch.tensor([float(groups.position)])
    dist.all_reduce(value, group=groups.group_for(CPGroup(ranks=(0, 1, 2, 3), sample_ids=(0,))))
    return {"lists": lists, "sum": value.item(), "count": groups.communicator_count()}


def test_domain_rank_lists_learnt_from_a_group():
    results = run_distributed(_lists_from_group_worker, 8)
    for result in results:
        assert result["lists"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
        assert result["sum"] == 6.0
        assert (result["count"].created, result["count"].reused) == (1, 1)


def _errors_worker(rank: int, world_size: int) -> list[str]:
    groups = DCPGroups.create([[0, 1, 2, 3, 4, 5]], 2)
    messages = []
    calls = [
        lambda: groups.group(1),  # below min_cp_size
        lambda: groups.group(3),  # not a group size
        lambda: groups.group(2, position=(groups.position + 2) % 6),  # another rank's block
        lambda: groups.group_for(CPGroup(ranks=(1, 2), sample_ids=(0,))),  # misaligned
    ]
    if groups.position >= 4:
        calls.append(lambda: groups.group(4))  # positions 4, 5 are in no block of 4
    for call in calls:
        with pytest.raises(ValueError) as error:
            call()
        messages.append(str(error.value))
    groups.destroy()
    with pytest.raises(RuntimeError, match="destroy"):
        groups.group(2)
    return messages


def test_clear_errors_for_groups_that_do_not_exist():
    results = run_distributed(_errors_worker, 6)
    assert "sizes are (2, 4, 6)" in results[0][0]
    assert "no DCP group of size 3" in results[0][1]
    assert "not in this rank's block" in results[0][2]
    assert "not an aligned block" in results[0][3]
    assert "in no aligned block of size 4" in results[5][4]


def _bad_lists_worker(rank: int, world_size: int, lists: list) -> str:
    with pytest.raises(ValueError) as error:
        DCPGroups.create(lists, 1)
    return str(error.value)


@pytest.mark.parametrize(
    "lists, message",
    [
        ([[1, 0]], "strictly ascending"),
        ([[0], [0, 1]], "same size"),
        ([[0, 1], [1, 0]], "ascending"),
        ([[0, 2]], "outside world size"),
        ([], "empty"),
    ],
)
def test_invalid_rank_lists_are_rejected(lists, message):
    assert all(message in m for m in run_distributed(_bad_lists_worker, 2, lists))


def _group_timeouts(rank: int, world_size: int) -> list:
    groups = DCPGroups.create([list(range(world_size))], min_cp_size=2)
    try:
        return [
            (
                groups.group_for(CPGroup(tuple(range(size)), ()))
                ._get_backend(torch.device("cpu"))
                .options._timeout.total_seconds()
                if rank < size
                else None
            )
            for size in (2, 4)
        ]
    finally:
        groups.destroy()


def test_dcp_groups_take_the_default_groups_timeout():
    """A rank whose peer died waits megatron's --distributed-timeout-minutes in a DCP group's
    collective, not torch's own default (30 minutes on gloo)."""
    results = run_distributed(_group_timeouts, 4, collective_timeout_s=45)
    assert results[0] == [45.0, 45.0] and results[3] == [None, 45.0]
