"""verl 0.9.1's value model, the engine its PPO critic runs on Megatron, under megatron_dcp's
dynamic CP (gloo, CPU, 4 ranks).

``MegatronEngineWithValueHead.forward_backward_batch`` itself: verl's critic calls, the value
inference of ``_compute_values`` (``forward_only``, then the trainer's ``no_padding_2_padding``,
which right-shifts the values onto the response tokens) and the training call with verl's
``value_loss`` (the clipped value loss of its ``McoreCriticConfig``, token-mean), on a PPO batch
as verl's trainer hands it over (left-padded prompts, right-padded responses, converted by
verl's ``left_right_2_no_padding``). DCP on (DP×CP 4, static CP 2, a budget of 48 tokens: the
plan mixes CP 1 and CP 2 groups, asserted) against a single-process run written here: per-token
values in sample order, the shifted values, the loss and every gradient (value head included).
Dropout is off (the tiny GPT's config): equality of runs is claimed only so.

Stubs as in test_verl_engine.py: the CPU platform, and the engine made with ``__new__`` around
its configs (a real ``McoreCriticConfig``, whose ``engine`` is verl's ``McoreEngineConfig``; a
model config with ``model_type="value_model"``); the model is the tiny megatron GPT with its
output layer replaced by a width-1 value head, as verl's bridges' ``make_value_model`` does.

Without megatron_dcp's entries verl refuses the value model ("Dynamic CP currently supports
language models only"); with only the refusal lifted its value forward runs on the static CP
group (docs/rl.md, "verl's critic under DCP"). verl's other refusals stay (last test)."""

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
from test_verl_dcp import OPTIONS, init_verl_megatron, observe_verl_plans  # noqa: E402
from test_verl_engine import use_cpu_platform  # noqa: E402
from verl.workers.config import McoreCriticConfig, McoreEngineConfig  # noqa: E402
from verl.workers.engine.megatron import transformer_impl  # noqa: E402
from verl.workers.utils.losses import value_loss  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from megatron_dcp.integration.patches import table  # noqa: E402
from megatron_dcp.integration.patches.verl_critic import CRITIC_PATCHES  # noqa: E402
from megatron_dcp.integration.patches.verl_refusals import REFUSAL_PATCHES  # noqa: E402
from megatron_dcp.testing.gpt import build_tiny_gpt, gather_full_tensors, init_megatron  # noqa
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

VERL_PATCHES = CRITIC_PATCHES + REFUSAL_PATCHES  # the value forward, then the lift

TIMEOUT_S = 120
WORLD, CP, BUDGET = 4, 2, 48
# (prompt, response) lengths; the totals are test_verl_engine's (40, 7, 90, 30, 12, 55, 3, 20):
# at 48 tokens a rank, the 90- and 55-token samples need CP 2 and the others fit CP 1.
SHAPES = ((10, 30), (3, 4), (30, 60), (12, 18), (5, 7), (20, 35), (1, 2), (8, 12))
PAD = 0


class ValueHead(torch.nn.Module):
    """A value model's output layer: one replicated output per token, as megatron's GPTModel
    calls its output layer (``(hidden, weight=, runtime_gather_output=) -> (out, bias)``)."""

    def __init__(self, hidden_size: int, seed: int = 5):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(0.1 * torch.randn(1, hidden_size, generator=generator))
        self.bias = torch.nn.Parameter(torch.tensor([0.3]))
        self.sequence_parallel = False

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def value_model(cp: int):
    """The tiny GPT (the same weights in every layout) with a value head."""
    (model,) = build_tiny_gpt(cp=cp, options=OPTIONS)
    model.output_layer = ValueHead(OPTIONS.hidden_size)
    return model


def make_samples(seed: int = 3) -> list[dict]:
    """Prompt and response tokens, a response mask with some masked tokens (tool output), old
    values and returns per response token."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for prompt, response in SHAPES:
        tokens = torch.randint(1, OPTIONS.vocab_size, (prompt + response,), generator=generator)
        mask = (torch.rand(response, generator=generator) > 0.15).float()
        mask[0] = 1.0
        samples.append(
            {
                "prompt": tokens[:prompt],
                "response": tokens[prompt:],
                "mask": mask,
                "old_values": torch.randn(response, generator=generator),
                "returns": torch.randn(response, generator=generator),
            }
        )
    return samples


def padded_rows(samples: list[dict]) -> dict:
    """The trainer's padded layout: prompts left-padded, responses right-padded (per-token
    fields of the response or of every position: :func:`pad_responses`,
    :func:`pad_positions`)."""
    n = len(samples)
    width_p = max(len(s["prompt"]) for s in samples)
    width_r = max(len(s["response"]) for s in samples)
    rows = {"prompts": torch.full((n, width_p), PAD), "responses": torch.full((n, width_r), PAD)}
    rows["attention_mask"] = torch.zeros(n, width_p + width_r, dtype=torch.long)
    rows["response_mask"] = torch.zeros(n, width_r)
    for i, sample in enumerate(samples):
        p, r = len(sample["prompt"]), len(sample["response"])
        rows["prompts"][i, width_p - p :] = sample["prompt"]
        rows["responses"][i, :r] = sample["response"]
        rows["attention_mask"][i, width_p - p : width_p + r] = 1
        rows["response_mask"][i, :r] = sample["mask"]
    rows["input_ids"] = torch.cat([rows["prompts"], rows["responses"]], 1)
    rows["position_ids"] = (rows["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return rows


def pad_responses(rows: dict, samples: list[dict], name: str) -> None:
    """``rows[name]``: each sample's ``name`` over its response, right-padded with 0."""
    rows[name] = torch.zeros(rows["responses"].shape)
    for i, sample in enumerate(samples):
        rows[name][i, : len(sample[name])] = sample[name]


def pad_positions(rows: dict, samples: list[dict], name: str, fill: float) -> None:
    """``rows[name]``: each sample's ``[length, ...]`` ``name`` at its input positions (prompt
    left-padded, response right-padded), ``fill`` elsewhere."""
    width_p, (n, width) = rows["prompts"].shape[1], rows["input_ids"].shape
    first = samples[0][name]
    rows[name] = torch.full((n, width, *first.shape[1:]), fill, dtype=first.dtype)
    for i, sample in enumerate(samples):
        start = width_p - len(sample["prompt"])
        rows[name][i, start : start + len(sample[name])] = sample[name]


def no_padding_batch(rows: dict, **settings):
    """verl's no-padding layout of the trainer's rows (``left_right_2_no_padding``), with the
    batch's non-tensor settings."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = left_right_2_no_padding(TensorDict(rows, batch_size=[len(rows["prompts"])]))
    tu.assign_non_tensor(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=1, **settings)
    return batch


def critic_batch(samples: list[dict]):
    """What verl's trainer hands the critic (``_update_critic``): verl's no-padding layout."""
    rows = padded_rows(samples)
    for name in ("old_values", "returns"):
        pad_responses(rows, samples, name)
    rows["values"] = rows.pop("old_values")
    return no_padding_batch(rows, global_batch_size=len(samples))


def critic_config() -> McoreCriticConfig:
    engine = McoreEngineConfig(
        dynamic_context_parallel=True,
        max_seqlen_per_dp_cp_rank=BUDGET,
        context_parallel_size=CP,
        use_remove_padding=True,
    )
    return McoreCriticConfig(ppo_micro_batch_size_per_gpu=1, megatron=engine)


def critic_engine(model, critic: McoreCriticConfig):
    """verl's value engine around ``model`` (the stubbed construction: module docstring)."""
    from transformers import LlamaConfig

    engine_class = transformer_impl.MegatronEngineWithValueHead
    engine = engine_class.__new__(engine_class)
    engine.engine_config = critic.engine
    engine.model_config = SimpleNamespace(
        model_type="value_model",
        hf_config=LlamaConfig(architectures=["LlamaForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=PAD),
        mtp=SimpleNamespace(enable=False, enable_train=False),
    )
    engine.module, engine.tf_config, engine.is_value_model = [model], model.config, True
    engine.enable_routing_replay, engine.mini_layer_topk_idx_list = False, []
    return engine


def critic_step(rank: int, world_size: int, samples) -> dict:
    """verl's value inference and its critic training call, on this rank."""
    use_cpu_platform()
    plans = observe_verl_plans()
    init_verl_megatron(CP)  # install_upstream_api: verl is imported, so its entries apply
    model = value_model(CP)
    critic = critic_config()
    engine = critic_engine(model, critic)
    batch = critic_batch(samples)
    with torch.no_grad():
        inferred = engine.forward_backward_batch(batch.clone(), None, forward_only=True)
    trained = engine.forward_backward_batch(batch, partial(value_loss, config=critic))
    # finalize_model_grads divides by the summed local token counts: every real token.
    tokens = sum(len(s["prompt"]) + len(s["response"]) for s in samples)
    values = inferred["model_output"].get("values")
    return {
        "lifted": all(table.is_applied(entry) for entry in VERL_PATCHES),
        "values": None if values is None else list(values.unbind()),
        "vpreds": None if values is None else no_padding_2_padding(values, batch),
        "loss": sum(trained["loss"]),
        "grads": {name: g / tokens for name, g in gather_full_tensors([model]).items()},
        "ran": plans[-1],
    }


def clipped_value_loss(vpred, sample: dict, clip: float) -> torch.Tensor:
    """PPO's clipped value loss of one response, summed over its loss tokens (× ½)."""
    old, returns = sample["old_values"], sample["returns"]
    clipped = old + (vpred - old).clamp(-clip, clip)
    per_token = torch.maximum((vpred - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * (per_token * sample["mask"]).sum()


def critic_reference(rank: int, world_size: int, samples) -> dict:
    """One process, no CP, each sequence on its own: values at every position, the value at
    position t−1 as the prediction for response token t, the token-mean loss and its gradients."""
    init_megatron(seed=OPTIONS.seed)
    model = value_model(cp=1)
    clip = critic_config().cliprange_value
    count = sum(float(s["mask"].sum()) for s in samples)
    values, vpreds, total = [], [], 0.0
    for sample in samples:
        tokens = torch.cat([sample["prompt"], sample["response"]])
        out = model(
            input_ids=tokens.view(1, -1),
            position_ids=torch.arange(len(tokens)).view(1, -1),
            attention_mask=None,
        ).view(-1)
        start = len(sample["prompt"]) - 1
        vpred = out[start : start + len(sample["response"])]
        loss = clipped_value_loss(vpred, sample, clip) / count
        loss.backward()
        total += loss.item()
        values.append(out.detach())
        vpreds.append(vpred.detach())
    grads = gather_full_tensors([model])
    return {"values": values, "vpreds": vpreds, "loss": total, "grads": grads}


def loss_and_gradient_differences(results: list[dict], want: dict) -> dict:
    """Every rank's loss (relative) and gradients (each relative to the largest entry of the
    same parameter) against the reference's."""
    return {
        "loss": max(abs(r["loss"] / want["loss"] - 1) for r in results),
        "gradient": max(
            ((r["grads"][name] - g).abs().max() / g.abs().max()).item()
            for r in results
            for name, g in want["grads"].items()
        ),
    }


def largest_differences(results: list[dict], want: dict) -> dict:
    """The output rank's values (as verl returns them, and right-shifted), then every rank's
    loss and gradients."""
    (output,) = [r for r in results if r["values"] is not None]
    vpreds = [row[: len(v)] for row, v in zip(output["vpreds"], want["vpreds"])]
    return {
        "value": max((a - b).abs().max().item() for a, b in zip(output["values"], want["values"])),
        "shifted value": max((a - b).abs().max().item() for a, b in zip(vpreds, want["vpreds"])),
        **loss_and_gradient_differences(results, want),
    }


def test_critic_under_dcp_equals_single_process():
    samples = make_samples()
    results = run_distributed(critic_step, WORLD, samples, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(critic_reference, 1, samples, timeout_s=TIMEOUT_S)
    assert all(r["lifted"] for r in results)
    assert_covers([r["ran"] for r in results], Layout(dp=WORLD // CP, cp=CP), mix_of={1, 2})
    output = results[0]  # DP 0, CP 0: the rank verl collects the values from
    assert output["values"] is not None and len(output["values"]) == len(samples)
    for got, want in zip(output["values"], reference["values"]):  # sample order, every position
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for row, want, sample in zip(output["vpreds"], reference["vpreds"], samples):
        torch.testing.assert_close(row[: len(want)], want, rtol=1e-5, atol=1e-5)
        assert not row[len(sample["response"]) :].any()  # the response's padding
    assert reference["grads"]["output_layer.weight"].abs().max() > 0
    for result in results:
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    print("critic under DCP vs single process:", largest_differences(results, reference))


def refusal(engine_config, model_config, tf_config=None, batch=None) -> str:
    """verl's DCP check as verl's engine calls it: its message, or "" when it lets through."""
    try:
        transformer_impl._check_dcp_unsupported_features(
            engine_config, model_config, tf_config=tf_config, batch=batch
        )
    except (NotImplementedError, ValueError) as error:
        return str(error)
    return ""


def test_only_the_value_model_refusal_is_lifted():
    """In this process, the two entries applied (and restored): a value model passes verl's DCP
    check; multimodal, VPP, FP8 and distillation are still refused; without the forward
    entry the value model is refused again."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    engine = McoreEngineConfig(dynamic_context_parallel=True, max_seqlen_per_dp_cp_rank=8)
    value = SimpleNamespace(model_type="value_model", hf_config=SimpleNamespace())
    vision = SimpleNamespace(model_type="value_model", hf_config=SimpleNamespace(vision_config=1))
    distilling = TensorDict({}, batch_size=[])
    tu.assign_non_tensor(distilling, distillation_use_topk=True)
    before = [table.is_applied(entry) for entry in VERL_PATCHES]
    vpp = McoreEngineConfig(
        dynamic_context_parallel=True,
        max_seqlen_per_dp_cp_rank=8,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    )
    try:
        for entry in VERL_PATCHES:
            table.apply(entry)
        assert refusal(engine, value) == ""
        assert "multimodal" in refusal(engine, vision)
        assert "virtual pipeline" in refusal(vpp, value)
        assert "FP8" in refusal(engine, value, tf_config=SimpleNamespace(fp8="e4m3"))
        assert "distillation" in refusal(engine, value, batch=distilling)
        table.restore(VERL_PATCHES[0])
        assert "language models only" in refusal(engine, value)
    finally:  # this process's entries as they were
        for entry, was_applied in zip(VERL_PATCHES, before):
            (table.apply if was_applied else table.restore)(entry)
