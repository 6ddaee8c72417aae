"""verl 0.9.1's top-k distillation on its Megatron engine under megatron_dcp's dynamic CP (gloo,
CPU, 4 ranks).

``MegatronEngineWithLMHead.forward_backward_batch`` itself, the actor's training call with
verl's ``distillation_ppo_loss`` (``forward_kl_topk``, supervised: ``use_policy_gradient`` and
``use_task_rewards`` off, so verl's trainer sets ``distillation_use_topk`` and
``distillation_only``), on a batch as verl's trainer hands it over: prompts left-padded,
responses right-padded, some response tokens masked, the teacher's top-k log-probs and ids per
input position (``teacher_logprobs`` / ``teacher_ids`` ``[batch, width, k]``, padded as verl's
``_pad_teacher_outputs`` pads them), all through verl's ``left_right_2_no_padding``. DCP on
(DP×CP 4, static CP 2, a budget of 48 tokens: the plan mixes CP 1 and CP 2 groups, asserted)
against a single-process run written here (each sequence on its own, the student's log-softmax
at position t against the teacher's top-k at t, on the response positions verl's
``no_padding_2_padding`` takes): the loss and every gradient. Dropout is off (the tiny GPT's
config): equality of runs is claimed only so.

Stubs as in test_verl_engine.py: the CPU platform, and the engine made with ``__new__`` around
its configs (a real ``McoreEngineConfig``, a real ``McoreActorConfig`` and
``DistillationConfig``). Without megatron_dcp's top-k entry verl refuses distillation ("Dynamic
CP does not support distillation"); with only the refusal lifted its loss cuts the teacher's rows
on the static CP group (docs/rl.md, "verl's distillation under DCP"). verl's other refusals
stay (last test)."""

from types import SimpleNamespace

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
for extra_module in ("verl", "tensordict", "transformers"):
    pytest.importorskip(
        extra_module, reason="needs the `verl` extra (scripts/setup_env.sh installs it)"
    )

from functools import partial  # noqa: E402

import torch  # noqa: E402
from test_verl_critic import (  # noqa: E402
    loss_and_gradient_differences,
    no_padding_batch,
    pad_positions,
    padded_rows,
    refusal,
)
from test_verl_dcp import OPTIONS, init_verl_megatron, observe_verl_plans  # noqa: E402
from test_verl_engine import lm_engine, use_cpu_platform  # noqa: E402
from verl.trainer.distillation import distillation_ppo_loss  # noqa: E402
from verl.workers.config import (  # noqa: E402
    DistillationConfig,
    DistillationLossConfig,
    McoreActorConfig,
)

from megatron_dcp.integration.patches import table  # noqa: E402
from megatron_dcp.integration.patches.verl_critic import CRITIC_PATCHES  # noqa: E402
from megatron_dcp.integration.patches.verl_distill import VERL_DISTILL_PATCHES  # noqa: E402
from megatron_dcp.integration.patches.verl_refusals import REFUSAL_PATCHES  # noqa: E402
from megatron_dcp.testing.gpt import build_tiny_gpt, gather_full_tensors, init_megatron  # noqa
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

VERL_PATCHES = CRITIC_PATCHES + REFUSAL_PATCHES  # the value forward, then the lift

TIMEOUT_S = 120
WORLD, CP, BUDGET = 4, 2, 48
TOPK, TEMPERATURE, PAD = 4, 0.8, 0
# (prompt, response) lengths, test_verl_critic's: the 90- and 55-token samples need CP 2.
SHAPES = ((10, 30), (3, 4), (30, 60), (12, 18), (5, 7), (20, 35), (1, 2), (8, 12))
ENTRIES = VERL_PATCHES + VERL_DISTILL_PATCHES


def make_samples(seed: int = 4) -> list[dict]:
    """Tokens, a response mask with some masked tokens, and a peaked teacher's top-k log-probs
    and ids at every position (most of the teacher's mass in its top k)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for prompt, response in SHAPES:
        length = prompt + response
        tokens = torch.randint(1, OPTIONS.vocab_size, (length,), generator=generator)
        mask = (torch.rand(response, generator=generator) > 0.15).float()
        mask[0] = 1.0
        teacher = 3.0 * torch.randn(length, OPTIONS.vocab_size, generator=generator)
        top_log_probs, top_ids = teacher.log_softmax(-1).topk(TOPK, dim=-1)
        samples.append(
            {"prompt": tokens[:prompt], "response": tokens[prompt:], "mask": mask,
             "teacher_logprobs": top_log_probs, "teacher_ids": top_ids}
        )
    return samples


def distill_batch(samples: list[dict]):
    """What verl's trainer hands the actor (``_update_actor``) for top-k distillation: the
    teacher's rows padded with log-prob 0 and the pad id."""
    rows = padded_rows(samples)
    pad_positions(rows, samples, "teacher_logprobs", 0.0)
    pad_positions(rows, samples, "teacher_ids", PAD)
    return no_padding_batch(
        rows,
        temperature=TEMPERATURE,
        distillation_use_topk=True,
        distillation_only=True,
        global_batch_size=len(samples),
    )


def distill_loss(engine):
    """verl's actor loss for supervised top-k distillation (``engine_workers``' partial)."""
    actor = McoreActorConfig(
        megatron=engine.engine_config,
        ppo_micro_batch_size_per_gpu=1,
        ppo_mini_batch_size=len(SHAPES),
        rollout_n=1,
    )
    loss = DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=TOPK, use_task_rewards=False, use_policy_gradient=False
    )
    config = DistillationConfig(enabled=False, distillation_loss=loss)
    return partial(distillation_ppo_loss, config=actor, distillation_config=config), config


def distill_step(rank: int, world_size: int, samples) -> dict:
    """verl's actor training call with top-k distillation, on this rank."""
    use_cpu_platform()
    plans = observe_verl_plans()
    init_verl_megatron(CP)  # install_upstream_api: verl is imported, so its entries apply
    (model,) = build_tiny_gpt(cp=CP, options=OPTIONS)
    engine = lm_engine(model, CP, BUDGET)
    loss_function, _ = distill_loss(engine)
    trained = engine.forward_backward_batch(distill_batch(samples), loss_function)
    # finalize_model_grads divides by the summed local token counts: every real token.
    tokens = sum(len(s["prompt"]) + len(s["response"]) for s in samples)
    return {
        "lifted": all(table.is_applied(entry) for entry in ENTRIES),
        "loss": sum(trained["loss"]),
        "grads": {name: g / tokens for name, g in gather_full_tensors([model]).items()},
        "ran": plans[-1],
    }


def forward_kl_topk(log_probs, sample: dict, clamps) -> torch.Tensor:
    """Per-position forward KL of the teacher's top-k against the student, verl's clamps."""
    log_prob_clamp, loss_clamp = clamps
    teacher = sample["teacher_logprobs"].clamp_min(log_prob_clamp)
    student = log_probs.gather(-1, sample["teacher_ids"]).clamp_min(log_prob_clamp)
    kl = (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)
    return kl.clamp(-loss_clamp, loss_clamp)


def distill_reference(rank: int, world_size: int, samples) -> dict:
    """One process, no CP, each sequence on its own: the student's log-softmax (temperature
    applied) at position t against the teacher's top-k at t, for the response positions
    ``prompt−1 … prompt+response−2``, token-mean over the batch's loss tokens; gradients."""
    init_megatron(seed=OPTIONS.seed)
    (model,) = build_tiny_gpt(options=OPTIONS)
    _, config = distill_loss(SimpleNamespace(engine_config=None))
    settings = config.distillation_loss
    clamps = (settings.log_prob_min_clamp, settings.loss_max_clamp)
    count = sum(float(s["mask"].sum()) for s in samples)
    total = 0.0
    for sample in samples:
        tokens = torch.cat([sample["prompt"], sample["response"]])
        logits = model(
            input_ids=tokens.view(1, -1),
            position_ids=torch.arange(len(tokens)).view(1, -1),
            attention_mask=None,
        )
        kl = forward_kl_topk((logits[0] / TEMPERATURE).log_softmax(-1), sample, clamps)
        start = len(sample["prompt"]) - 1
        loss = (kl[start : start + len(sample["response"])] * sample["mask"]).sum() / count
        loss.backward()
        total += loss.item()
    return {"loss": total, "grads": gather_full_tensors([model])}


def test_topk_distillation_under_dcp_equals_single_process():
    samples = make_samples()
    results = run_distributed(distill_step, WORLD, samples, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(distill_reference, 1, samples, timeout_s=TIMEOUT_S)
    assert all(r["lifted"] for r in results)
    assert_covers([r["ran"] for r in results], Layout(dp=WORLD // CP, cp=CP), mix_of={1, 2})
    assert reference["loss"] > 0 and reference["grads"]["output_layer.weight"].abs().max() > 0
    differences = loss_and_gradient_differences(results, reference)
    print("top-k distillation under DCP vs single process:", differences)
    for result in results:
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_only_the_distillation_refusal_is_lifted_with_the_fix():
    """In this process, the entries applied (and restored): a distillation batch passes verl's
    DCP check, with its flags left as they were; multimodal, VPP and FP8 are still refused;
    without the top-k entry distillation is refused again."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import McoreEngineConfig

    engine = McoreEngineConfig(dynamic_context_parallel=True, max_seqlen_per_dp_cp_rank=8)
    vpp = McoreEngineConfig(
        dynamic_context_parallel=True, max_seqlen_per_dp_cp_rank=8,
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
    )
    model = SimpleNamespace(model_type="language_model", hf_config=SimpleNamespace())
    vision = SimpleNamespace(
        model_type="language_model", hf_config=SimpleNamespace(vision_config=1)
    )
    batches = [TensorDict({}, batch_size=[]) for _ in range(2)]
    tu.assign_non_tensor(batches[0], distillation_use_topk=True)
    tu.assign_non_tensor(batches[1], distillation_only=True)
    before = [table.is_applied(entry) for entry in ENTRIES]
    try:
        for entry in ENTRIES:
            table.apply(entry)
        for batch in batches:
            assert refusal(engine, model, batch=batch) == ""
        assert tu.get_non_tensor_data(batches[0], key="distillation_use_topk", default=False)
        assert "multimodal" in refusal(engine, vision, batch=batches[0])
        assert "virtual pipeline" in refusal(vpp, model, batch=batches[0])
        assert "FP8" in refusal(engine, model, tf_config=SimpleNamespace(fp8="e4m3"))
        table.restore(VERL_DISTILL_PATCHES[0])
        for batch in batches:
            assert "does not support distillation" in refusal(engine, model, batch=batch)
    finally:  # this process's entries as they were
        for entry, was_applied in zip(ENTRIES, before):
            (table.apply if was_applied else table.restore)(entry)
