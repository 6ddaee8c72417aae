"""Zero-length samples inside a CP group, in the RL adapter: ``shard_per_token`` lays out
per-token values exactly like the packed tokens, and ``merge_outputs`` gives every sample's
values back (empty ones empty), with the empty samples first, in the middle and last in a group
of a plan the caller passes in, in groups holding nothing but empty samples, and wherever the
planner puts them in a plan made here."""

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
from megatron_dcp.integration.process_groups import create_dcp_groups  # noqa: E402
from megatron_dcp.scheduling import CPGroup, Domain, MicroBatch, Plan  # noqa: E402
from megatron_dcp.testing.gpt import init_megatron, make_samples  # noqa: E402
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    assert_covers,
    parallel_layout,
    plan_of,
)

BUDGET = 64
LENGTHS = [0, 30, 0, 20, 0, 40, 0, 9]
# One micro-batch over dp 2 × cp 2: group (0, 1) holds empty samples first, in the middle and
# last; group (2, 3) a long one, an empty one and a short one.
CALLER_PLAN = Plan(
    tuple(LENGTHS),
    Domain(2, 2, BUDGET),
    (MicroBatch((CPGroup((0, 1), (0, 1, 2, 3, 4)), CPGroup((2, 3), (5, 6, 7)))),),
)
# Two micro-batches: a CP-2 group (0, 1) and then a CP-1 group (2,) hold only empty samples (each
# packs one all-padding sequence, which must not shift any other sample's tokens).
ALL_EMPTY_PLAN = Plan(
    tuple(LENGTHS),
    Domain(2, 2, BUDGET),
    (
        MicroBatch((CPGroup((0, 1), (0, 2)), CPGroup((2,), (1,)), CPGroup((3,), (3,)))),
        MicroBatch((CPGroup((0, 1), (5,)), CPGroup((2,), (4, 6)), CPGroup((3,), (7,)))),
    ),
)
PLANS = {"caller-plan": CALLER_PLAN, "all-empty-groups": ALL_EMPTY_PLAN, "planned": None}


def values_of(lengths) -> list:
    """One distinct float per token of every sample (sample j's start at 1000·j)."""
    return [torch.arange(n, dtype=torch.float64) + 1000 * j for j, n in enumerate(lengths)]


def per_token_model(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A stand-in for a model's per-token output with a feature dimension: ``[..., 2]``."""
    return torch.stack([tokens.double(), labels.double() ** 2 + 0.5], dim=-1)


def round_trip(rank: int, world_size: int, plan_name: str) -> dict:
    init_megatron(cp=2)
    groups = create_dcp_groups()
    samples = make_samples(LENGTHS)
    config = DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, cp_size=2)
    plan = PLANS[plan_name]
    split = split_batch(samples, groups, config, plan=plan.validate() if plan else None)
    laid_out_like_packing = all(
        torch.equal(
            shard_per_token([s[name] for s in samples], split, index), getattr(mb.packed, name)
        )
        for index, mb in enumerate(split.microbatches)
        for name in ("tokens", "labels")
    )
    shards = [shard_per_token(values_of(LENGTHS), split, i) for i in range(len(split.microbatches))]
    merged = merge_outputs(shards, split, groups)
    outputs = [per_token_model(mb.packed.tokens, mb.packed.labels) for mb in split.microbatches]
    modelled = merge_outputs(outputs, split, groups)
    groups.destroy()
    positions = [
        (group.sample_ids.index(j), len(group.sample_ids))
        for mb in split.plan.microbatches
        for group in mb.groups
        for j in group.sample_ids
        if LENGTHS[j] == 0
    ]
    return dict(
        laid_out=laid_out_like_packing,
        merged=merged,
        modelled=modelled,
        empty_positions=positions,
        ran=plan_of(split.plan, parallel_layout()),
    )


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_zero_length_samples_round_trip(plan_name):
    results = run_distributed(round_trip, 4, plan_name, timeout_s=60)
    # The same per-token function on the un-sharded samples: sample j gives [len_j, 2].
    unsharded = [per_token_model(s["tokens"], s["labels"]) for s in make_samples(LENGTHS)]
    for result in results:
        assert result["laid_out"]
        assert len(result["merged"]) == len(result["modelled"]) == len(LENGTHS)
        for got, want in zip(result["merged"], values_of(LENGTHS)):
            assert got.shape == want.shape and torch.equal(got, want)
        for got, want in zip(result["modelled"], unsharded):
            assert got.shape == want.shape and torch.equal(got, want)
    assert [tuple(t.shape) for t in unsharded] == [(n, 2) for n in LENGTHS]
    if plan_name == "planned":  # the planner's plan: groups of 1 and 2 holding empty samples
        assert_covers([result["ran"] for result in results], Layout(dp=2, cp=2))
    placed = results[0]["empty_positions"]
    if plan_name == "caller-plan":
        assert {index for index, _ in placed} >= {0, 2, 4}  # first, middle, last of (0..4)
    if plan_name != "all-empty-groups":
        assert any(size > 1 for _, size in placed), "no empty sample shares a group"
