"""Value models, reward models and distillation through the RL adapter (CPU, gloo, tiny GPT,
dropout off so that runs can be equal): each DCP run at dp2·cp2 and tp2·cp2 (world 4) equals a
single-process, no-CP run of the same samples, written here without the adapter's helpers, in
its loss and every gradient (TP shards gathered). Each run's plan mixes CP sizes 1 and 2
(asserted). The value model's per-token values come back in order and right-shifted per sample;
the reward model's scores are read at each sample's last token; pairs of a Bradley–Terry loss
are split across CP groups and micro-batches (asserted); the distillation teacher runs its own
plan, different from the student's (asserted)."""

import contextlib
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_dcp.adapters import (  # noqa: E402
    SCALAR_HEAD_WIDTH,
    DCPConfig,
    attach_scalar_head,
    bradley_terry_loss,
    clipped_value_loss,
    full_vocab_logits,
    gather_scores,
    kl_per_token,
    last_token_mask,
    masked_mean_loss,
    merge_outputs,
    plan_batch,
    score_loss_backward,
    shard_per_token,
    split_batch,
    teacher_top_k,
    to_state_positions,
    values_of_tokens,
)
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.process_groups import create_dcp_groups  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    init_from_global_names,
    init_megatron,
    make_samples,
)
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    RanPlan,
    assert_covers,
    parallel_layout,
)

OPTIONS = TinyGPTOptions()
TEACHER = TinyGPTOptions(seed=77)
TIMEOUT_S = 90
CLIP = 0.2
POLICY_BUDGET_LESS = 32  # the actor's budget on the same rollouts is this much smaller
LAYOUTS = [pytest.param(1, id="dp2cp2"), pytest.param(2, id="tp2cp2")]  # (tp) at world 4


@dataclass(frozen=True)
class Rollouts:
    """A mini-batch of rollouts with per-token targets and per-sample scores."""

    samples: list
    response: list  # per sample [L] float: 1 on response tokens
    returns: list
    old_values: list
    targets: list  # per sample: a target score (pointwise reward model)
    pairs: list  # (chosen, rejected) sample ids

    @property
    def response_tokens(self) -> int:
        return int(sum(mask[1:].sum() for mask in self.response))  # token 0 has no value


def make_rollouts(lengths: Sequence[int], seed: int) -> Rollouts:
    samples = make_samples(lengths, OPTIONS.vocab_size, seed=seed)
    rng = torch.Generator().manual_seed(seed)
    response = []
    for length in lengths:
        mask = torch.zeros(length)
        mask[random.Random(seed + length).randint(1, max(1, length // 2)) :] = 1
        response.append(mask)
    returns = [torch.randn(length, generator=rng) for length in lengths]
    old = [torch.randn(length, generator=rng) * 0.1 for length in lengths]
    targets = torch.randn(len(lengths), generator=rng).tolist()
    pairs = [(i, i + 1) for i in range(0, len(lengths) - 1, 2)]
    return Rollouts(samples, response, returns, old, targets, pairs)


@dataclass(frozen=True)
class Run:
    """What one rank (or the reference) computed: named losses, per-sample outputs, gradients
    per loss, and the plan it ran."""

    losses: dict
    outputs: dict = field(repr=False)
    grads: dict = field(repr=False)
    ran: Any = None
    extra: Any = None


def setup_rank(tp: int, cp: int, options: TinyGPTOptions, scalar: bool):
    init_megatron(tp=tp, cp=cp, seed=options.seed)
    apply_patches()
    (model,) = build_tiny_gpt(tp=tp, cp=cp, options=options)
    if scalar:
        attach_scalar_head(model)
        init_from_global_names(model, options.seed)  # the head too, by its name
    return model


def forward(model, mb) -> torch.Tensor:
    packed = mb.packed
    return model(
        input_ids=packed.tokens,
        position_ids=packed.position_ids,
        attention_mask=None,
        packed_seq_params=mb.packed_seq_params,
    )


def forward_whole(model, sample) -> torch.Tensor:
    tokens = sample["tokens"].view(1, -1)
    positions = torch.arange(tokens.numel()).view(1, -1)
    return model(input_ids=tokens, position_ids=positions, attention_mask=None)


def domain_sum(value: torch.Tensor) -> float:
    from megatron.core import parallel_state

    total = value.detach().clone()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return float(total)


def ran_plan(split) -> RanPlan:
    sizes = tuple(mb.local_cp_size for mb in split.microbatches)
    return RanPlan(sizes, len(sizes), parallel_layout())


# ------------------------------------------------------------------------------------------------
# Value model (critic)
# ------------------------------------------------------------------------------------------------


def critic_step(
    rank: int, world: int, rollouts: Rollouts, tp: int, budget: int, sp: bool
) -> Run:
    options = dataclasses.replace(OPTIONS, sequence_parallel=sp)
    model = setup_rank(tp, 2, options, scalar=True)
    groups = create_dcp_groups()
    config = DCPConfig.for_model(model.config, budget, vocab_size=SCALAR_HEAD_WIDTH)
    split = split_batch(rollouts.samples, groups, config)
    aligned = [to_state_positions(x) for x in (rollouts.old_values, rollouts.returns)]
    mask = to_state_positions(rollouts.response)
    count = int(sum(m.sum() for m in mask))
    outputs, loss = [], torch.zeros(())
    for mb in split.microbatches:
        out = forward(model, mb)
        old, ret, weight = (shard_per_token(x, split, mb.index) for x in (*aligned, mask))
        part = clipped_value_loss(out[..., 0], old, ret, weight, count, split, CLIP)
        part.backward()
        outputs.append(out.detach())
        loss += part.detach()
    values = values_of_tokens(merge_outputs(outputs, split, groups))
    grads = gather_full_tensors([model])
    policy_budget = budget - POLICY_BUDGET_LESS
    policy = DCPConfig.for_model(model.config, policy_budget, vocab_size=OPTIONS.vocab_size)
    seqlens = split.plan.seqlens
    policy_plan = plan_batch(seqlens, groups.domain_size, policy, groups.domain_ranks)
    groups.destroy()
    layouts = {
        "critic": (split.plan.cp_size_histogram(), config.cost_model.linear),
        "policy": (policy_plan.cp_size_histogram(), policy.cost_model.linear),
    }
    losses, values = {"value": domain_sum(loss)}, {"value": values}
    return Run(losses, values, {"value": grads}, ran_plan(split), layouts)


def critic_reference(rank: int, world: int, rollouts: Rollouts) -> Run:
    """PPO's clipped value loss with the value of token t taken from position t − 1."""
    model = setup_rank(1, 1, OPTIONS, scalar=True)
    count, total, values = rollouts.response_tokens, 0.0, []
    for i, sample in enumerate(rollouts.samples):
        out = forward_whole(model, sample)[0, :, 0]
        v, old, ret = out[:-1], rollouts.old_values[i][1:], rollouts.returns[i][1:]
        clipped = old + torch.clamp(v - old, -CLIP, CLIP)
        per_token = 0.5 * torch.max((v - ret) ** 2, (clipped - ret) ** 2)
        loss = (per_token * rollouts.response[i][1:]).sum() / count
        loss.backward()
        total += float(loss)
        values.append(torch.cat([torch.zeros(1), out.detach()[:-1]]))
    grads = gather_full_tensors([model])
    return Run({"value": total}, {"value": values}, {"value": grads})


# ------------------------------------------------------------------------------------------------
# Reward model: pointwise and pairwise
# ------------------------------------------------------------------------------------------------


def reward_step(rank: int, world: int, rollouts: Rollouts, tp: int, budget: int) -> Run:
    model = setup_rank(tp, 2, OPTIONS, scalar=True)
    groups = create_dcp_groups()
    config = DCPConfig.for_model(model.config, budget, vocab_size=SCALAR_HEAD_WIDTH)
    split = split_batch(rollouts.samples, groups, config)
    count = len(rollouts.samples)
    targets = [torch.full_like(m, y) for m, y in zip(rollouts.response, rollouts.targets)]
    pointwise, outputs = torch.zeros(()), []
    for mb in split.microbatches:  # pointwise: no communication beyond megatron's own
        out = forward(model, mb)
        error = (out[..., 0] - shard_per_token(targets, split, mb.index)) ** 2
        part = masked_mean_loss(error, last_token_mask(split, mb.index), count, split)
        part.backward()
        pointwise += part.detach()
        outputs.append(out.detach())
    with counted_collectives() as calls:
        scores = gather_scores(outputs, split, groups)
    pointwise_grads = gather_full_tensors([model])
    for param in model.parameters():
        param.grad = None
    outputs = [forward(model, mb) for mb in split.microbatches]  # pairwise: graphs kept
    pair_loss = score_loss_backward(
        outputs, split, groups, lambda s: bradley_terry_loss(s, rollouts.pairs)
    )
    grads = {"pointwise": pointwise_grads, "pairwise": gather_full_tensors([model])}
    where = {i: (mb.index, mb.sample_ids) for mb in split.microbatches for i in mb.sample_ids}
    groups.destroy()
    losses = {"pointwise": domain_sum(pointwise), "pairwise": float(pair_loss)}
    return Run(losses, {"scores": scores}, grads, ran_plan(split), (where, calls))


@contextlib.contextmanager
def counted_collectives():
    """The torch.distributed collectives made inside: (name, elements, group size) each."""
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")}

    def counting(name):
        def call(tensor, *args, group=None, **kwargs):
            size = tensor.numel() if torch.is_tensor(tensor) else sum(t.numel() for t in tensor)
            calls.append((name, size, dist.get_world_size(group)))
            return originals[name](tensor, *args, group=group, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def reward_reference(rank: int, world: int, rollouts: Rollouts) -> Run:
    model = setup_rank(1, 1, OPTIONS, scalar=True)
    scores = torch.stack([forward_whole(model, s)[0, -1, 0] for s in rollouts.samples])
    target = torch.tensor(rollouts.targets)
    ((scores - target) ** 2).mean().backward()
    pointwise_grads = gather_full_tensors([model])
    for param in model.parameters():
        param.grad = None
    scores = torch.stack([forward_whole(model, s)[0, -1, 0] for s in rollouts.samples])
    chosen, rejected = zip(*rollouts.pairs)
    margin = scores[list(chosen)] - scores[list(rejected)]
    pair_loss = torch.log1p(torch.exp(-margin)).mean()
    pair_loss.backward()
    losses = {"pointwise": float(((scores - target) ** 2).mean()), "pairwise": float(pair_loss)}
    grads = {"pointwise": pointwise_grads, "pairwise": gather_full_tensors([model])}
    return Run(losses, {"scores": scores.detach()}, grads)


# ------------------------------------------------------------------------------------------------
# Distillation
# ------------------------------------------------------------------------------------------------

TOP_K = 8


def teacher_outputs(rollouts: Rollouts, case: tuple, groups):
    """The teacher's log-probabilities per sample, from its own DCP plan: top-k ``(values,
    ids)`` (over its vocabulary shards under ``vocab_parallel``) or the full ``[L, V]`` (ids
    None); and the teacher's plan."""
    tp, top_k, _, (_, budget), vocab_parallel = case
    teacher = setup_teacher(tp)
    split = split_batch(rollouts.samples, groups, DCPConfig.for_model(teacher.config, budget))
    values, ids = [], []
    with torch.no_grad():
        for mb in split.microbatches:
            logits = forward(teacher, mb)
            if top_k:
                shards = logits if vocab_parallel else full_vocab_logits(logits)
                top_values, top_ids = teacher_top_k(shards, top_k, vocab_parallel)
                values.append(top_values)
                ids.append(top_ids)
            else:
                values.append(torch.log_softmax(full_vocab_logits(logits).float(), dim=-1))
    merged_ids = merge_outputs(ids, split, groups) if top_k else None
    return merge_outputs(values, split, groups), merged_ids, split.plan


def setup_teacher(tp: int):
    (teacher,) = build_tiny_gpt(tp=tp, cp=2, options=TEACHER)
    return teacher


def distill_step(rank: int, world: int, rollouts: Rollouts, case: tuple) -> Run:
    tp, top_k, direction, budgets, vocab_parallel = case
    model = setup_rank(tp, 2, OPTIONS, scalar=False)
    groups = create_dcp_groups()
    values, ids, teacher_plan = teacher_outputs(rollouts, case, groups)
    split = split_batch(rollouts.samples, groups, DCPConfig.for_model(model.config, budgets[0]))
    count, loss = rollouts.response_tokens, torch.zeros(())
    mask = [torch.cat([torch.zeros(1), m[1:]]) for m in rollouts.response]
    for mb in split.microbatches:
        logits = forward(model, mb)
        logits = logits if vocab_parallel else full_vocab_logits(logits)
        teacher = shard_per_token(values, split, mb.index)
        teacher_ids = shard_per_token(ids, split, mb.index) if top_k else None
        kl = kl_per_token(logits, teacher, teacher_ids, direction, vocab_parallel)
        part = masked_mean_loss(kl, shard_per_token(mask, split, mb.index), count, split)
        part.backward()
        loss += part.detach()
    grads = gather_full_tensors([model])
    groups.destroy()
    plans = (split.plan.microbatches, teacher_plan.microbatches)
    return Run({"kl": domain_sum(loss)}, {}, {"kl": grads}, ran_plan(split), plans)


def distill_reference(rank: int, world: int, rollouts: Rollouts, case: tuple) -> Run:
    _, top_k, direction, _, _ = case
    model = setup_rank(1, 1, OPTIONS, scalar=False)
    (teacher,) = build_tiny_gpt(options=TEACHER)
    total = 0.0
    for i, sample in enumerate(rollouts.samples):
        with torch.no_grad():
            p = F.log_softmax(forward_whole(teacher, sample)[0].float(), dim=-1)
        q = F.log_softmax(forward_whole(model, sample)[0].float(), dim=-1)
        if top_k:
            p, ids = p.sort(dim=-1, descending=True)
            p, q = p[:, :top_k], q.gather(-1, ids[:, :top_k])
        per_token = (p.exp() * (p - q)) if direction == "forward" else (q.exp() * (q - p))
        weight = rollouts.response[i].clone()
        weight[0] = 0
        loss = (per_token.sum(-1) * weight).sum() / rollouts.response_tokens
        loss.backward()
        total += float(loss)
    return Run({"kl": total}, {}, {"kl": gather_full_tensors([model])})


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------

LENGTHS = [71, 9, 33, 120, 18, 54, 7, 90]


def assert_equal_runs(results: Sequence[Run], reference: Run, scale: float) -> None:
    """Every rank's losses, outputs and gradients equal the reference's (gradients compared at
    ``scale``, the summed-loss scale of the pretraining oracle)."""
    for result in results:
        for name, want in reference.losses.items():
            assert result.losses[name] == pytest.approx(want, rel=1e-5, abs=1e-7), name
        for name, want in reference.outputs.items():
            got = result.outputs[name]
            for sample_id, (a, b) in enumerate(zip(got, want)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{name} {sample_id}")
        for loss, grads in reference.grads.items():
            assert result.grads[loss].keys() == grads.keys()
            for name, grad in grads.items():
                got = result.grads[loss][name] * scale
                message = f"{loss}: {name}"
                torch.testing.assert_close(got, grad * scale, rtol=1e-4, atol=1e-5, msg=message)


def budget_of(tp: int) -> int:
    """A budget under which the longest sample needs CP 2 and short ones run on CP 1."""
    return 64 if tp == 1 else 96


@pytest.mark.parametrize(
    "tp, sp", [(1, False), (2, False), (2, True)], ids=["dp2cp2", "tp2cp2", "tp2cp2-sp"]
)
def test_value_model_equals_single_process(tp, sp):
    """Under sequence parallelism the scalar head gathers the sequence first (the reference
    runs without it)."""
    rollouts = make_rollouts(LENGTHS, seed=3)
    budget = budget_of(tp)
    results = run_distributed(critic_step, 4, rollouts, tp, budget, sp, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(critic_reference, 1, rollouts, timeout_s=TIMEOUT_S)
    assert_covers([r.ran for r in results], Layout(tp=tp, dp=2 // tp, cp=2))  # CP 1 and 2
    assert_equal_runs(results, reference, rollouts.response_tokens)
    (critic, critic_linear), (policy, policy_linear) = results[0].extra.values()
    assert critic != policy, "the critic ran the policy's layout"
    assert critic_linear < policy_linear  # its head is width 1: no vocabulary projection


@pytest.mark.parametrize("tp", LAYOUTS)
def test_reward_model_pointwise_and_pairwise_equal_single_process(tp):
    rollouts = make_rollouts(LENGTHS, seed=5)
    results = run_distributed(reward_step, 4, rollouts, tp, budget_of(tp), timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reward_reference, 1, rollouts, timeout_s=TIMEOUT_S)
    assert_covers([r.ran for r in results], Layout(tp=tp, dp=2 // tp, cp=2))
    where = {}
    for result in results:
        where.update(result.extra[0])
        # the scores' gather: one all-reduce of one float per sample over the DP×CP domain
        assert result.extra[1] == [("all_reduce", len(LENGTHS), 4 // tp)]
    apart = [(c, r) for c, r in rollouts.pairs if where[c] != where[r]]
    assert apart, "every pair shares a CP group: the scores never had to meet"
    assert_equal_runs(results, reference, len(LENGTHS))


DISTILL_CASES = [  # (tp, top-k (0: full log-probs), direction, (student, teacher) budgets,
    # the student's logits kept as vocabulary shards under TP)
    pytest.param((1, TOP_K, "forward", (64, 96), False), id="dp2cp2-topk-forward"),
    pytest.param((2, 0, "reverse", (96, 160), False), id="tp2cp2-full-reverse"),
    pytest.param((2, TOP_K, "reverse", (96, 160), True), id="tp2cp2-topk-reverse-vocab-parallel"),
    pytest.param((2, 0, "forward", (96, 160), True), id="tp2cp2-full-forward-vocab-parallel"),
]


@pytest.mark.parametrize("case", DISTILL_CASES)
def test_distillation_equals_single_process(case):
    rollouts = make_rollouts(LENGTHS, seed=7)
    results = run_distributed(distill_step, 4, rollouts, case, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(distill_reference, 1, rollouts, case, timeout_s=TIMEOUT_S)
    tp = case[0]
    assert_covers([r.ran for r in results], Layout(tp=tp, dp=2 // tp, cp=2))
    student, teacher = results[0].extra
    assert student != teacher, "the teacher ran the student's plan"
    assert_equal_runs(results, reference, rollouts.response_tokens)
