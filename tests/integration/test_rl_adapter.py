"""The RL adapter on megatron-core (CPU, gloo): every rank holds the whole mini-batch,
``split_batch`` + ``token_mean_loss`` give the single-process token-mean gradients (1e-4) and
``merge_outputs`` the single-process per-sample log-probs (1e-5), in order; the failure modes of
known RL integrations (dropped or duplicated sequences, CP silently off with fewer sequences than
ranks, token counts multiplied by the CP size) cannot happen; MTP runs with CP > 1."""

import random
from dataclasses import dataclass, field
from typing import Sequence

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch.distributed as dist  # noqa: E402

from megatron_dcp.adapters import (  # noqa: E402
    DCPConfig,
    SplitBatch,
    merge_outputs,
    plan_batch,
    reassemble,
    shard_per_token,
    split_batch,
    token_mean_loss,
    token_mean_scale,
)
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.process_groups import create_dcp_groups  # noqa: E402
from megatron_dcp.integration.training.forward_step import forward_step  # noqa: E402
from megatron_dcp.runtime.packing import pack_samples  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    Sample,
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
    make_samples,
    packed_token_losses,
    unpacked_token_losses,
)
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    RanPlan,
    assert_covers,
    parallel_layout,
)

OPTIONS = TinyGPTOptions()
TIMEOUT_S = 60


@dataclass(frozen=True)
class RankResult:
    """What one rank saw and computed through the adapter."""

    position: int
    dp_cp_rank: int
    cp_sizes: tuple[int, ...]
    groups: tuple[tuple[int, tuple[int, ...]], ...]  # (first position, sample ids) per micro-batch
    real_tokens: tuple[int, ...]  # loss tokens this rank holds, per micro-batch
    num_tokens: int
    local_num_tokens: int
    log_probs: list = field(repr=False)
    grads: dict = field(repr=False)
    num_microbatches: int
    layout: Layout


@dataclass(frozen=True)
class Reference:
    num_tokens: int
    log_probs: list = field(repr=False)
    grads: dict = field(repr=False)  # of the token-mean loss


def adapter_step(
    rank: int, world_size: int, samples: Sequence[Sample], cp: int, budget: int
) -> RankResult:
    """An engine's step: split, forward+backward per micro-batch, merge log-probs."""
    from megatron.core import parallel_state

    init_megatron(cp=cp, seed=OPTIONS.seed)
    apply_patches()
    (model,) = build_tiny_gpt(cp=cp, options=OPTIONS)
    groups = create_dcp_groups()
    split = split_batch(samples, groups, DCPConfig.for_model(model.config, budget))
    log_probs = []
    for mb in split.microbatches:
        assert_shards_like_packing(samples, split, mb.index)
        losses = packed_token_losses(model, mb.packed, mb.packed_seq_params)
        token_mean_loss(losses, mb, split).backward()
        log_probs.append(-losses.detach())
    merged = merge_outputs(log_probs, split, groups)
    grads = gather_full_tensors([model])
    groups.destroy()
    domain = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return RankResult(
        position=split.position,
        dp_cp_rank=dist.get_rank(domain),
        cp_sizes=tuple(mb.local_cp_size for mb in split.microbatches),
        groups=tuple((split.position - mb.cp_rank, mb.sample_ids) for mb in split.microbatches),
        real_tokens=tuple(mb.packed.num_tokens for mb in split.microbatches),
        num_tokens=split.num_tokens,
        local_num_tokens=split.local_num_tokens,
        log_probs=merged,
        grads=grads,
        num_microbatches=len(split.microbatches),
        layout=parallel_layout(),
    )


def assert_shards_like_packing(samples: Sequence[Sample], split, index: int) -> None:
    """``shard_per_token`` lays out per-token values exactly as the packing lays out tokens."""
    packed = split.microbatches[index].packed
    for name in ("labels", "loss_mask"):
        shard = shard_per_token([s[name] for s in samples], split, index)
        assert torch.equal(shard.to(getattr(packed, name).dtype), getattr(packed, name)), name


def reference_step(rank: int, world_size: int, samples: Sequence[Sample]) -> Reference:
    """One process, no CP, no packing: per-sample log-probs and token-mean-loss gradients."""
    init_megatron(seed=OPTIONS.seed)
    (model,) = build_tiny_gpt(options=OPTIONS)
    num_tokens = sum(int((s["loss_mask"] != 0).sum()) for s in samples)
    log_probs = []
    for sample in samples:
        if sample["tokens"].numel() == 0:
            log_probs.append(torch.zeros(0))
            continue
        losses = unpacked_token_losses(model, sample)
        ((losses * sample["loss_mask"].view(1, -1)).sum() / num_tokens).backward()
        log_probs.append(-losses.detach().view(-1))
    return Reference(num_tokens, log_probs, gather_full_tensors([model]))


def random_lengths(count: int, seed: int, longest: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, longest) for _ in range(count)]


def budget_for(lengths: Sequence[int], world: int, floor: int = 32) -> int:
    """An even budget that fits the longest sequence on the whole domain, so plans mix sizes."""
    need = -(-max(lengths) // world) + 2
    return max(floor, need + need % 2)


def run_adapter(lengths: Sequence[int], world: int, cp: int, budget: int):
    """Every rank's adapter results and the single-process reference on the same samples."""
    samples = make_samples(lengths, OPTIONS.vocab_size, seed=len(lengths))
    results = run_distributed(adapter_step, world, samples, cp, budget, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reference_step, 1, samples, timeout_s=TIMEOUT_S)
    return results, reference


def assert_matches_reference(results: Sequence[RankResult], reference: Reference) -> None:
    for result in results:
        assert result.num_tokens == reference.num_tokens
        assert len(result.log_probs) == len(reference.log_probs)
        for sample_id, (got, want) in enumerate(zip(result.log_probs, reference.log_probs)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"sample {sample_id}")
        assert result.grads.keys() == reference.grads.keys()
        # Token-mean gradients are 1/T of the summed-loss ones: compare at the summed scale, so
        # atol means what it means in the pretraining oracle (test_dcp_oracle.py).
        tokens = reference.num_tokens
        for name, grad in reference.grads.items():
            torch.testing.assert_close(
                result.grads[name] * tokens, grad * tokens, rtol=1e-4, atol=1e-5, msg=name
            )


def assert_no_failure_mode(results: Sequence[RankResult], num_samples: int) -> None:
    """Every sample in exactly one CP group; CP siblings pack the same samples; no rank idle;
    each loss token counted once over the domain."""
    assert [r.position for r in results] == [r.dp_cp_rank for r in results]
    by_group = {}
    for result in results:
        for index, group in enumerate(result.groups):
            assert by_group.setdefault((index, group[0]), group[1]) == group[1]
    seen = sorted(i for ids in by_group.values() for i in ids)
    assert seen == list(range(num_samples)), "a sample was dropped or duplicated"
    assert sum(r.local_num_tokens for r in results) == results[0].num_tokens
    assert all(r.real_tokens and max(r.real_tokens) > 0 for r in results), "a rank had no work"


# (lengths, world, static cp, budget, the plan's CP sizes: None for a mix); with today's scheduler
# the plans of world4-8seqs, world4-3seqs and world8-12seqs mix CP sizes across micro-batches,
# world8-5seqs runs two groups of 4 side by side (static CP's groups: the case is about fewer
# sequences than ranks, as is world4-3seqs).
CASES = [
    pytest.param(random_lengths(8, seed=4), 4, 2, 48, None, id="world4-8seqs"),
    pytest.param(random_lengths(3, seed=2), 4, 2, 32, None, id="world4-3seqs"),
    pytest.param(random_lengths(12, seed=6), 8, 4, 64, None, id="world8-12seqs"),
    pytest.param(random_lengths(5, seed=3), 8, 4, 64, {4}, id="world8-5seqs"),
]


@pytest.mark.parametrize("lengths, world, cp, budget, cp_sizes", CASES)
def test_gradients_and_log_probs_equal_single_process(lengths, world, cp, budget, cp_sizes):
    results, reference = run_adapter(lengths, world, cp, budget)
    assert_covers(results, Layout(dp=world // cp, cp=cp), cp_sizes=cp_sizes)
    assert_matches_reference(results, reference)
    assert_no_failure_mode(results, len(lengths))


def test_one_long_sequence_runs_on_all_8_ranks():
    """Fewer sequences than ranks must not turn CP off: one sequence needing the whole domain
    runs with local_cp_size 8, every rank holds real tokens, and the token count is the
    sequence's (not 8× it)."""
    results, reference = run_adapter([200], world=8, cp=2, budget=32)
    assert_covers(results, Layout(dp=4, cp=2), cp_sizes={8}, num_microbatches=1)
    assert all(r.local_num_tokens > 0 for r in results)
    assert_matches_reference(results, reference)
    assert_no_failure_mode(results, 1)


def test_short_and_empty_sequences_fewer_than_ranks():
    """Two short sequences and an empty one on 8 ranks with a large budget: no rank idle, the
    empty sample comes back empty, nothing double-counted."""
    results, reference = run_adapter([10, 0, 6], world=8, cp=4, budget=64)
    assert_covers(results, Layout(dp=2, cp=4), cp_sizes={4})  # static CP's groups, no rank idle
    assert_matches_reference(results, reference)
    assert_no_failure_mode(results, 3)
    assert results[0].log_probs[1].numel() == 0


def schedule_step(
    rank: int, world_size: int, samples: Sequence[Sample], cp: int, budget: int
) -> tuple[int, dict, RanPlan]:
    """The engine path through megatron's own schedule: ``as_batch`` + the per-token-loss
    forward step; the schedule returns loss sums and local token counts (no scale applied)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_megatron(cp=cp, seed=OPTIONS.seed)
    apply_patches()
    (model,) = build_tiny_gpt(cp=cp, options=OPTIONS)
    groups = create_dcp_groups()
    split = split_batch(samples, groups, DCPConfig.for_model(model.config, budget))
    batches = [mb.as_batch() for mb in split.microbatches]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=max(b["tokens"].shape[-1] for b in batches),
        micro_batch_size=1,
        forward_only=False,
    )
    tokens = torch.tensor(sum(int(r["lm loss"][1]) for r in reports))
    dist.all_reduce(tokens)  # what finalize_model_grads does over DP×CP
    grads = gather_full_tensors([model])
    groups.destroy()
    sizes = tuple(mb.local_cp_size for mb in split.microbatches)
    ran = RanPlan(sizes, len(batches), parallel_layout())
    return int(tokens), {name: grad / int(tokens) for name, grad in grads.items()}, ran


def test_megatron_schedule_with_per_token_loss_needs_no_scale():
    """Through ``get_forward_backward_func`` with ``calculate_per_token_loss``: the DP×CP sum of
    the local token counts is the mini-batch's count, and dividing the summed gradients by it
    (finalize_model_grads) gives the token-mean gradients."""
    lengths = random_lengths(3, seed=2)
    samples = make_samples(lengths, OPTIONS.vocab_size, seed=len(lengths))
    results = run_distributed(schedule_step, 4, samples, 2, 32, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reference_step, 1, samples, timeout_s=TIMEOUT_S)
    assert_covers([ran for _, _, ran in results], Layout(dp=2, cp=2))  # a mix of CP sizes
    for tokens, grads, _ in results:
        assert tokens == reference.num_tokens
        for name, grad in reference.grads.items():
            torch.testing.assert_close(
                grads[name] * tokens, grad * tokens, rtol=1e-4, atol=1e-5, msg=name
            )


# ------------------------------------------------------------------------------------------------
# MTP with CP > 1
# ------------------------------------------------------------------------------------------------


def mtp_step(rank: int, world_size: int, samples: Sequence[Sample], budget: int) -> list:
    """Forward+backward of a tiny GPT with one MTP layer through the adapter; returns the CP
    sizes with which this rank entered ``process_mtp_loss``, and whether MTP grads are finite."""
    from megatron.core.models.gpt import gpt_model

    init_megatron(cp=2, seed=OPTIONS.seed)
    apply_patches()
    (model,) = build_tiny_gpt(cp=2, mtp_layers=1, options=OPTIONS)
    entered = []
    original = gpt_model.process_mtp_loss

    def counting(*args, **kwargs):
        entered.append(kwargs["cp_group"].size())
        return original(*args, **kwargs)

    gpt_model.process_mtp_loss = counting  # a forked worker: the parent is untouched
    groups = create_dcp_groups()
    split = split_batch(samples, groups, DCPConfig.for_model(model.config, budget))
    for mb in split.microbatches:
        losses = packed_token_losses(model, mb.packed, mb.packed_seq_params)
        token_mean_loss(losses, mb, split).backward()
    grads = gather_full_tensors([model])
    groups.destroy()
    mtp = [g for name, g in grads.items() if name.startswith("mtp.")]
    finite = all(bool(torch.isfinite(g).all()) for g in mtp) and any(g.abs().sum() > 0 for g in mtp)
    sizes = [mb.local_cp_size for mb in split.microbatches]
    return [entered, sizes, finite, RanPlan(tuple(sizes), len(sizes), parallel_layout())]


def test_mtp_with_cp_through_the_adapter():
    """Every CP rank enters the MTP loss (its label rolling talks across the micro-batch's CP
    group: a rank skipping it would hang the others until the harness kills the job)."""
    samples = make_samples([90, 7, 30], OPTIONS.vocab_size, seed=5)
    results = run_distributed(mtp_step, 4, samples, 32, timeout_s=TIMEOUT_S)
    # 90 tokens need the whole domain at budget 32: every micro-batch on CP 4
    assert_covers([ran for *_, ran in results], Layout(dp=2, cp=2), cp_sizes={4})
    for entered, cp_sizes, finite, _ in results:
        assert entered == cp_sizes
        assert max(cp_sizes) > 1
        assert finite


# ------------------------------------------------------------------------------------------------
# Single process: layout, reassembly, loss scale, errors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("domain, cp", [(4, 2), (8, 4), (8, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reassemble_inverts_packing_for_every_position(domain, cp, seed):
    """Packing every position's share then reassembling gives back every sample, in order,
    for token ids (1-D) and a per-token feature (2-D)."""
    lengths = random_lengths(seed + 2, seed, longest=120) + [0]
    samples = make_samples(lengths, seed=seed)
    config = DCPConfig(max_seqlen_per_dp_cp_rank=budget_for(lengths, domain, 8), cp_size=cp)
    plan = plan_batch(lengths, domain, config)
    parts = [[] for _ in range(domain)]
    for microbatch in plan.microbatches:
        for group in microbatch.groups:
            for cp_rank, position in enumerate(group.ranks):
                packed = pack_samples(
                    [samples[i] for i in group.sample_ids],
                    group.size,
                    cp_rank,
                    config.pad_multiple(group.size),
                )
                parts[position].append(packed.tokens[0])
    flat = [torch.cat(p) for p in parts]
    merged = reassemble(plan, config, flat, ())
    assert [m.tolist() for m in merged] == [s["tokens"].tolist() for s in samples]
    wide = [torch.stack([f, -f], dim=1) for f in flat]
    merged = reassemble(plan, config, wide, (2,))
    assert [m[:, 1].tolist() for m in merged] == [(-s["tokens"]).tolist() for s in samples]


def test_token_mean_scale():
    assert token_mean_scale(200) == pytest.approx(1 / 200)
    assert token_mean_scale(200, domain_size=8, grad_reduce="mean") == pytest.approx(8 / 200)
    assert token_mean_scale(0, domain_size=8) == 0.0
    with pytest.raises(ValueError, match="grad_reduce"):
        token_mean_scale(10, 8, grad_reduce="avg")
    with pytest.raises(ValueError, match="num_tokens=-1"):
        token_mean_scale(-1)


def test_settings_and_plan_errors_name_the_argument():
    with pytest.raises(ValueError, match="max-seqlen-per-dp-cp-rank"):
        DCPConfig(max_seqlen_per_dp_cp_rank=7)
    with pytest.raises(ValueError, match="scheduler"):
        DCPConfig(max_seqlen_per_dp_cp_rank=64, scheduler="nope")
    with pytest.raises(ValueError, match="domain_size=6"):
        plan_batch([5, 6], 6, DCPConfig(max_seqlen_per_dp_cp_rank=64, cp_size=4))


def test_shard_per_token_rejects_values_of_the_wrong_length():
    config = DCPConfig(max_seqlen_per_dp_cp_rank=64)
    split = SplitBatch(plan_batch([3, 5], 2, config), config, 0, (), 8)
    with pytest.raises(ValueError, match="one per sample"):
        shard_per_token([torch.zeros(3)], split, 0)
    with pytest.raises(ValueError, match=r"values\[1\] has shape \(4,\); expected \[5"):
        shard_per_token([torch.zeros(3), torch.zeros(4)], split, 0)


# Lengths whose plan on 4 ranks, 2 per node, differs with and without the node layout.
NODE_LENGTHS = [503, 1229, 1130, 283, 773, 1252]
NODE_CONFIG = DCPConfig(1024, cp_size=2, ranks_per_node=2, hardware="h100-nvlink")


def split_plan_step(rank: int, world_size: int, samples: Sequence[Sample]):
    init_megatron(cp=2, seed=OPTIONS.seed)
    groups = create_dcp_groups()
    plan, ranks = split_batch(samples, groups, NODE_CONFIG).plan, tuple(groups.domain_ranks)
    groups.destroy()
    return plan, ranks


def test_plans_price_cp_groups_across_nodes():
    """``plan_batch`` with the domain's global ranks plans over the node layout (groups of 4 span
    both nodes of 2), and ``split_batch`` passes them itself: its plan is the node-aware one."""
    blind = plan_batch(NODE_LENGTHS, 4, NODE_CONFIG)
    aware = plan_batch(NODE_LENGTHS, 4, NODE_CONFIG, range(4))
    assert aware.microbatches != blind.microbatches
    samples = make_samples(NODE_LENGTHS, OPTIONS.vocab_size, seed=3)
    for plan, ranks in run_distributed(split_plan_step, 4, samples, timeout_s=TIMEOUT_S):
        assert ranks == (0, 1, 2, 3) and plan.microbatches == aware.microbatches
