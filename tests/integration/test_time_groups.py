"""The host groups a step's busy times travel over (``integration/training/time_groups.py``): on
a GPU job the DP×CP domain, TP and PP groups are NCCL's, and the times go over gloo twins made
once, so that reading the gathered times waits for no kernel. Here (gloo only) the twins are
forced: each holds the ranks of its group, in order, and the gathered times equal those gathered
over the groups themselves. tp2·pp2 (world 4, CP 1): every kind of group is there."""

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.training.dcp_schedule import busy_times  # noqa: E402
from megatron_dcp.integration.training.time_groups import ranks_of, time_groups  # noqa: E402
from megatron_dcp.testing.gpt import init_megatron  # noqa: E402


def twins_and_times(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    init_megatron(2, 2, 1)
    domain = parallel_state.get_data_parallel_group(with_context_parallel=True)
    groups, twins = time_groups(domain), time_groups(domain, twins=True)
    values = [0.5 * rank, 1.0 + rank, 2.0 - 0.25 * rank]  # unclaimed, two micro-batches
    kinds = ("domain", "tp", "pp")
    return {
        "ranks": [(ranks_of(getattr(groups, k)), ranks_of(getattr(twins, k))) for k in kinds],
        "new": [getattr(groups, k) is not getattr(twins, k) for k in kinds],
        "backends": [dist.get_backend(getattr(twins, k)) for k in kinds],
        "times": (busy_times(values, groups), busy_times(values, twins)),
    }


def test_gloo_twins_hold_their_groups_ranks_and_carry_the_same_times():
    results = run_distributed(twins_and_times, 4, timeout_s=120)
    for rank, result in enumerate(results):
        for own, twin in result["ranks"]:
            assert own == twin and rank in own, (rank, own, twin)
        assert all(result["new"]) and set(result["backends"]) == {"gloo"}
        over_groups, over_twins = result["times"]
        assert over_groups == over_twins
        # TP 2 runs in step: the slower of the two; PP 2: the stages add up.
        assert len(over_groups) == 1 and over_groups == results[0]["times"][0]
    tp_slowest = [max(0.5 * r, 0.5 * (r + 1)) for r in (0, 2)]
    assert over_groups[0][0] == pytest.approx(sum(tp_slowest))
