"""Distillation through the RL adapter at verl's loss positions (CPU, gloo, tiny GPT, dropout off
so that runs can be equal).

A causal LM's logits at position t, the student's and the teacher's, are a distribution over
token t + 1, so response token t + 1 is scored at position t. verl takes exactly those positions
(``no_padding_2_padding``: ``prompt − 1 … prompt + response − 2`` for the response) and
``to_state_positions`` of the response mask marks them. The batch is verl's trainer's
(test_verl_distill's: prompts left-padded, responses right-padded, some response tokens masked,
the teacher's top-k per input position, through ``left_right_2_no_padding``).

- The mask ``to_state_positions`` makes equals the positions verl's ``no_padding_2_padding``
  takes for each response token, weighted by the response mask; the response mask as it is
  does not.
- The adapter's path (``split_batch``, ``shard_per_token``, ``kl_per_token``,
  ``masked_mean_loss``) at dp2·cp2 (the plan mixes CP 1 and 2, asserted) with that mask equals a
  single-process run written here without the adapter's helpers (each sequence whole, forward KL
  of the teacher's top-k per position, verl's ``no_padding_2_padding`` picking the response
  positions, token-mean by the response mask): loss and every gradient. The same run with the
  unshifted response mask misses that loss by 2 %, 2000 times the tolerance (asserted: the
  check can fail).
"""

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
for extra_module in ("verl", "tensordict", "transformers"):
    pytest.importorskip(
        extra_module, reason="needs the `verl` extra (scripts/setup_env.sh installs it)"
    )

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_rl_models import assert_equal_runs, domain_sum, forward, forward_whole  # noqa: E402
from test_rl_models import Run, ran_plan  # noqa: E402
from test_verl_distill import CP, OPTIONS, distill_batch, make_samples  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from megatron_dcp.adapters import (  # noqa: E402
    DCPConfig,
    kl_per_token,
    masked_mean_loss,
    shard_per_token,
    split_batch,
    to_state_positions,
)
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.integration.process_groups import create_dcp_groups  # noqa: E402
from megatron_dcp.testing.gpt import build_tiny_gpt, gather_full_tensors  # noqa: E402
from megatron_dcp.testing.gpt import init_megatron  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

WORLD, BUDGET, TIMEOUT_S = 4, 48, 90


def verl_rows():
    """verl's batch and, per sample, its tokens, the teacher's top-k ``(log-probs, ids)`` per
    input position and the response mask over the whole sequence (0 on the prompt)."""
    batch = distill_batch(make_samples())
    tokens = batch["input_ids"].unbind()
    teacher = (batch["teacher_logprobs"].unbind(), batch["teacher_ids"].unbind())
    prompt = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(1).tolist()
    response = batch["response_mask"]
    masks = []
    for i, seq in enumerate(tokens):
        mask = torch.zeros(len(seq))
        mask[prompt[i] :] = response[i, : len(seq) - prompt[i]]
        masks.append(mask)
    return batch, list(tokens), [list(t) for t in teacher], masks


def verl_loss_weights(batch, lengths) -> list:
    """Per sample and position, the response mask at the position verl scores each response
    token at: the positions come from verl's own ``no_padding_2_padding``."""
    positions = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths])
    picked = no_padding_2_padding(positions, batch).long()  # [samples, max response]
    response = batch["response_mask"]
    weights = []
    for i, length in enumerate(lengths):
        weight = torch.zeros(length)
        held = batch["attention_mask"][i, batch["prompts"].shape[1] :].sum()
        weight[picked[i, :held]] = response[i, :held].float()
        weights.append(weight)
    return weights


def adapter_samples(tokens, masks) -> list:
    return [
        {"tokens": seq, "labels": torch.roll(seq, -1), "loss_mask": mask}
        for seq, mask in zip(tokens, masks)
    ]


def student_step(rank: int, world: int) -> Run:
    """The adapter's distillation path; the loss with the response mask moved by
    ``to_state_positions`` (back-propagated) and, from the same KL, with it unmoved."""
    init_megatron(cp=CP, seed=OPTIONS.seed)
    apply_patches()
    (model,) = build_tiny_gpt(cp=CP, options=OPTIONS)
    groups = create_dcp_groups()
    _, tokens, (values, ids), masks = verl_rows()
    samples = adapter_samples(tokens, masks)
    split = split_batch(samples, groups, DCPConfig.for_model(model.config, BUDGET))
    shifted = to_state_positions(masks)
    count = int(sum(m.sum() for m in shifted))
    shifted_loss, unshifted_loss = torch.zeros(()), torch.zeros(())
    for mb in split.microbatches:
        teacher = [shard_per_token(x, split, mb.index) for x in (values, ids)]
        kl = kl_per_token(forward(model, mb), *teacher, direction="forward")
        part = masked_mean_loss(kl, shard_per_token(shifted, split, mb.index), count, split)
        part.backward()
        shifted_loss += part.detach()
        mask = shard_per_token(masks, split, mb.index)
        unshifted_loss += masked_mean_loss(kl.detach(), mask, count, split)
    grads = gather_full_tensors([model])
    losses = {"kl": domain_sum(shifted_loss), "unshifted": domain_sum(unshifted_loss)}
    groups.destroy()
    return Run(losses, {}, {"kl": grads}, ran_plan(split))


def reference_step(rank: int, world: int) -> Run:
    """One process, no CP, each sequence whole: the forward KL of the teacher's top-k against
    the student's log-softmax at every position, verl's ``no_padding_2_padding`` picking the
    response's positions, the mean over the response mask's tokens."""
    init_megatron(seed=OPTIONS.seed)
    (model,) = build_tiny_gpt(options=OPTIONS)
    batch, tokens, (values, ids), _ = verl_rows()
    per_position = []
    for seq, teacher, top in zip(tokens, values, ids):
        student = F.log_softmax(forward_whole(model, {"tokens": seq})[0].float(), dim=-1)
        student = student.gather(-1, top)
        per_position.append((teacher.exp() * (teacher - student)).sum(-1))
    per_response = no_padding_2_padding(torch.cat(per_position), batch)
    response = batch["response_mask"].float()
    loss = (per_response * response).sum() / response.sum()
    loss.backward()
    return Run({"kl": float(loss)}, {}, {"kl": gather_full_tensors([model])})


def test_to_state_positions_marks_the_positions_verl_scores():
    batch, tokens, _, masks = verl_rows()
    weights = verl_loss_weights(batch, [len(seq) for seq in tokens])
    for sample_id, (shifted, weight) in enumerate(zip(to_state_positions(masks), weights)):
        assert torch.equal(shifted, weight), sample_id
    assert any(not torch.equal(m, w) for m, w in zip(masks, weights))


def test_distillation_at_verls_positions_equals_single_process():
    results = run_distributed(student_step, WORLD, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(reference_step, 1, timeout_s=TIMEOUT_S)
    assert_covers([r.ran for r in results], Layout(dp=WORLD // CP, cp=CP), mix_of={1, 2})
    count = int(sum(m.sum() for m in verl_rows()[3]))
    assert_equal_runs(results, reference, count)
    want = reference.losses["kl"]
    for result in results:  # the response mask as it is: 100× the loss's tolerance (1e-5) off
        assert abs(result.losses["unshifted"] - want) > 1e-3 * abs(want), result.losses
