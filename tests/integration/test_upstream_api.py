"""``megatron_dcp.install_upstream_api()``: megatron-core dev's dynamic-CP names on 0.19.2, each
installed only where missing (a name megatron-core has natively is left alone), idempotent,
refused after model parallelism was initialised without dynamic groups; the dynamic groups it
creates are this rank's blocks of the DP×CP domain, and dev's scheduler interface returns
megatron_dcp's plans. Each test runs in a forked worker so the patches never leak into the
pytest process."""

import inspect

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_dcp  # noqa: E402
from megatron_dcp.integration.patches import enable_cpu_backend  # noqa: E402

UPSTREAM_ENTRIES = {
    "upstream_scheduler",
    "upstream_group_getter",
    "upstream_destroy",
    "upstream_initialize",
    "upstream_config_init",
    "upstream_config_field",
}
TIMEOUT_S = 60


def _config(**fields):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **fields)


def install_twice(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.datasets import data_schedule

    first = megatron_dcp.install_upstream_api()
    second = megatron_dcp.install_upstream_api()
    signature = inspect.signature(parallel_state.initialize_model_parallel)
    try:
        _config(dynamic_context_parallel=True)
        refused = ""
    except ValueError as error:
        refused = str(error)
    from megatron_dcp.integration import patches

    return {
        "dcp applied": all(
            patches.is_applied(entry) for entry in patches.entries("dcp") if entry.when.holds()
        ),
        "first": set(first),
        "second": second,
        "keyword": "dynamic_context_parallel" in signature.parameters,
        "field": _config(dynamic_context_parallel=False).dynamic_context_parallel,
        "default": _config().dynamic_context_parallel,
        "refused": refused,
        "scheduler": data_schedule.DefaultDynamicCPScheduler.__module__,
    }


def test_install_is_idempotent_and_returns_what_it_installed():
    (result,) = run_distributed(install_twice, 1, timeout_s=TIMEOUT_S)
    assert UPSTREAM_ENTRIES <= result["first"]
    assert result["dcp applied"]  # per-micro-batch CP groups (maybe applied before: not in first)
    assert result["second"] == []
    assert result["keyword"] and result["field"] is False and result["default"] is False
    assert "dynamic_context_parallel=False" in result["refused"]
    assert result["scheduler"] == "megatron_dcp.integration.megatron_dev_api"


def install_over_native_names(rank: int, world_size: int) -> dict:
    """A megatron-core that has the scheduler and the group getter natively keeps them."""
    from megatron.core import parallel_state
    from megatron.core.datasets import data_schedule

    class NativeScheduler:
        pass

    def native_getter(check_initialized=True, group_size=None):
        return "native"

    data_schedule.DefaultDynamicCPScheduler = NativeScheduler
    parallel_state.get_dynamic_data_context_parallel_groups = native_getter
    installed = set(megatron_dcp.install_upstream_api())
    return {
        "installed": installed,
        "scheduler kept": data_schedule.DefaultDynamicCPScheduler is NativeScheduler,
        "getter kept": parallel_state.get_dynamic_data_context_parallel_groups is native_getter,
    }


def test_native_names_are_left_alone():
    (result,) = run_distributed(install_over_native_names, 1, timeout_s=TIMEOUT_S)
    assert result["scheduler kept"] and result["getter kept"]
    assert "upstream_scheduler" not in result["installed"]
    assert "upstream_group_getter" not in result["installed"]
    assert "upstream_initialize" in result["installed"]  # still missing natively


def install_after_initialize(rank: int, world_size: int) -> str:
    from megatron.core import parallel_state

    enable_cpu_backend()
    parallel_state.initialize_model_parallel()
    with pytest.raises(RuntimeError) as error:
        megatron_dcp.install_upstream_api()
    return str(error.value)


def test_install_after_initialize_names_the_fix():
    (message,) = run_distributed(install_after_initialize, 1, timeout_s=TIMEOUT_S)
    assert "initialize_model_parallel" in message and "Call it first" in message


def dynamic_groups(rank: int, world_size: int, cp: int) -> dict:
    """dev's calls in verl's order: install, initialise with the keyword, ask for groups."""
    from megatron.core import parallel_state

    enable_cpu_backend()
    megatron_dcp.install_upstream_api()
    parallel_state.initialize_model_parallel(
        context_parallel_size=cp, dynamic_context_parallel=True
    )
    members = {}
    for size in (1, 2, 4, world_size):
        group = parallel_state.get_dynamic_data_context_parallel_groups(group_size=size)
        position = torch.tensor([float(rank)])
        dist.all_reduce(position, group=group)
        members[size] = (tuple(dist.get_process_group_ranks(group)), position.item())
    domain = parallel_state.get_data_parallel_group(with_context_parallel=True)
    full_is_domain = (
        parallel_state.get_dynamic_data_context_parallel_groups(group_size=world_size) is domain
    )
    parallel_state.destroy_model_parallel()
    with pytest.raises(AssertionError, match="install_upstream_api"):
        parallel_state.get_dynamic_data_context_parallel_groups(group_size=2)
    return {"members": members, "full is domain": full_is_domain}


def test_dynamic_groups_are_aligned_blocks_of_the_domain():
    results = run_distributed(dynamic_groups, 8, 2, timeout_s=TIMEOUT_S)
    for rank, result in enumerate(results):
        assert result["full is domain"]
        for size, (ranks, summed) in result["members"].items():
            start = rank // size * size
            assert ranks == tuple(range(start, start + size)), (rank, size)
            assert summed == sum(ranks)


def test_scheduler_interface_returns_megatron_dcp_plans():
    """dev's ``get_groups_and_subsamples``: per micro-batch, every rank's sample ids; the ranks
    of a group hold the same list; ids are the caller's."""
    from megatron_dcp.integration.megatron_dev_api import DefaultDynamicCPScheduler
    from megatron_dcp.scheduling import build_scheduler

    lengths = [350, 20, 30, 90, 10, 64, 1, 7, 200]
    samples = [(100 + i, length) for i, length in enumerate(lengths)]
    scheduler = DefaultDynamicCPScheduler(max_seqlen_per_dp_cp_rank=100, cp_size=2, dp_size=2)
    groups = scheduler.get_groups_and_subsamples(samples)
    plan = build_scheduler(
        "default_dynamic_cp", dp_size=2, cp_size=2, max_seqlen_per_dp_cp_rank=100, min_cp_size=1
    ).schedule(lengths)
    assert len(groups) == plan.num_microbatches
    for ranks, microbatch in zip(groups, plan.microbatches):
        assert len(ranks) == 4 and all(ranks)
        for group in microbatch.groups:
            want = [100 + i for i in group.sample_ids]
            assert all(ranks[position] == want for position in group.ranks)
    seen = sorted(i for ranks in groups for i in {x for ids in ranks for x in ids})
    assert seen == sorted(100 + i for i in range(len(lengths)))


def test_scheduler_interface_rejects_a_sequence_longer_than_the_domain():
    from megatron_dcp.integration.megatron_dev_api import DefaultDynamicCPScheduler

    scheduler = DefaultDynamicCPScheduler(max_seqlen_per_dp_cp_rank=100, cp_size=2, dp_size=2)
    with pytest.raises(ValueError, match="max_seqlen_per_dp_cp_rank"):
        scheduler.get_groups_and_subsamples([(0, 50), (1, 401)])
