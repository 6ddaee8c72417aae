"""Zero-length samples inside a CP group, in the RL adapter: ``shard_per_token`` lays out
per-token values exactly like the packed tokens, and ``merge_outputs`` gives every sample's
values back (empty ones empty), with the empty samples first, in the middle and last in a group
of a plan the caller passes in, and wherever the planner puts them in a plan made here."""

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch  # noqa: E402

from megatron_dcp.adapters import (  # noqa: E402
    DCPConfig,
    merge_outputs,
    shard_per_token,
    split_batch,
)
from megatron_dcp.integration.dcp import create_dcp_groups  # noqa: E402
from megatron_dcp.scheduling import CPGroup, Domain, MicroBatch, Plan  # noqa: E402
from megatron_dcp.testing.gpt import init_megatron, make_samples  # noqa: E402

BUDGET = 64
LENGTHS = [0, 30, 0, 20, 0, 40, 0, 9]
# One micro-batch over dp 2 × cp 2: group (0, 1) holds empty samples first, in the middle and
# last; group (2, 3) a long one, an empty one and a short one.
CALLER_PLAN = Plan(
    tuple(LENGTHS),
    Domain(2, 2, BUDGET),
    (MicroBatch((CPGroup((0, 1), (0, 1, 2, 3, 4)), CPGroup((2, 3), (5, 6, 7)))),),
)


def values_of(lengths) -> list:
    """One distinct float per token of every sample (sample j's start at 1000·j)."""
    return [torch.arange(n, dtype=torch.float64) + 1000 * j for j, n in enumerate(lengths)]


def round_trip(rank: int, world_size: int, caller_plan: bool) -> dict:
    init_megatron(cp=2)
    groups = create_dcp_groups()
    samples = make_samples(LENGTHS)
    config = DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, cp_size=2)
    split = split_batch(
        samples, groups, config, plan=CALLER_PLAN.validate() if caller_plan else None
    )
    laid_out_like_packing = all(
        torch.equal(
            shard_per_token([s[name] for s in samples], split, index), getattr(mb.packed, name)
        )
        for index, mb in enumerate(split.microbatches)
        for name in ("tokens", "labels")
    )
    shards = [shard_per_token(values_of(LENGTHS), split, i) for i in range(len(split.microbatches))]
    merged = merge_outputs(shards, split, groups)
    groups.destroy()
    positions = [
        (group.sample_ids.index(j), len(group.sample_ids))
        for mb in split.plan.microbatches
        for group in mb.groups
        for j in group.sample_ids
        if LENGTHS[j] == 0
    ]
    return dict(laid_out=laid_out_like_packing, merged=merged, empty_positions=positions)


@pytest.mark.parametrize("caller_plan", [True, False], ids=["caller-plan", "planned"])
def test_zero_length_samples_round_trip(caller_plan):
    results = run_distributed(round_trip, 4, caller_plan, timeout_s=60)
    for result in results:
        assert result["laid_out"]
        for got, want in zip(result["merged"], values_of(LENGTHS)):
            assert torch.equal(got, want)
    placed = results[0]["empty_positions"]
    assert any(size > 1 for _, size in placed), "no empty sample shares a group"
    if caller_plan:
        assert {index for index, _ in placed} >= {0, 2, 4}  # first, middle, last of (0..4)
