"""MTP under verl's own dynamic-CP path, packing-independent (gloo, CPU; dropout off, so runs
can be equal).

verl's Megatron engine (``MegatronEngineWithLMHead.forward_backward_batch``, the stubs of
``test_verl_engine.py``) trains a tiny GPT with one MTP layer and verl's ``sft_loss`` through
verl's MTP forward (``gptmodel_forward_model_engine`` with ``mtp_enable_train``, verl's
``patch_engine_mtp`` postprocess). verl passes no MTP token ratios: megatron_dcp takes them from
the micro-batches verl hands megatron's schedule (entry ``upstream_mtp_ratios``, one all-reduce
per global batch) and ``process_mtp_loss`` weighs each depth by them (entry ``mtp_loss``).

The reference is megatron's own rule on one micro-batch holding the whole batch, one process,
no CP (as ``test_mtp_oracle.py``), in verl's layout: labels are the next tokens, the loss mask
is verl's rolled one. Two plans of the same batch (two budgets) must both equal it (rtol 1e-4),
and megatron's per-micro-batch rule (the entry switched off in the workers) must not.
"""

import dataclasses
from functools import partial

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
for extra_module in ("verl", "tensordict"):
    pytest.importorskip(
        extra_module, reason="needs the `verl` extra (scripts/setup_env.sh installs it)"
    )

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from test_verl_dcp import (  # noqa: E402
    OPTIONS,
    init_verl_megatron,
    observe_verl_plans,
    verl_batch,
)
from test_verl_engine import lm_engine, use_cpu_platform  # noqa: E402
from verl.workers.utils.losses import sft_loss  # noqa: E402

from megatron_dcp.integration.megatron_dev_api import DefaultDynamicCPScheduler  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
    make_samples,
    packed_loss_and_backward,
)
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

TIMEOUT_S = 180
LENGTHS = (37, 5, 120, 64, 9, 90, 33, 71)
WORLD, CP = 4, 2  # DP×CP; times TP ranks
# Two plans of the same batch, each mixing CP sizes: 48 gives CP 1, 2 and 4 in 3 micro-batches,
# 56 CP 2 and 4 in 2 (at 64 and above, up to 112, the planner returns the static plan, CP 2 only).
BUDGETS = (48, 56)


def options(depth: int):
    return dataclasses.replace(OPTIONS, mtp_layers=depth)


def engine_train(
    rank: int, world_size: int, samples, budget: int, depth: int, rule: str, tp: int = 1
):
    """verl's training call with ``sft_loss`` and MTP; ``rule="megatron"``: without the global
    ratios (megatron's per-micro-batch weighting). Full gradients over the routed-token count
    (what megatron's finalize_model_grads divides by under verl's per-token regime), and what
    verl's plan gave this rank."""
    from verl.utils.megatron_utils import patch_engine_mtp

    from megatron_dcp.integration.patches import dev_api

    if rule == "megatron":  # a forked worker: the parent is untouched
        dev_api.replicated_batch_ratios = lambda micro_batches, model: None
    use_cpu_platform()
    plans = observe_verl_plans()
    init_verl_megatron(CP, tp)
    (model,) = build_tiny_gpt(tp=tp, cp=CP, options=options(depth))
    engine = lm_engine(model, CP, budget)
    engine.model_config.mtp = SimpleNamespace(enable=True, enable_train=True, detach_encoder=False)
    patch_engine_mtp([model], engine.model_config)
    batch = verl_batch(samples)
    batch["temperature"] = torch.ones(len(samples))
    engine.forward_backward_batch(batch, partial(sft_loss, None), forward_only=False)
    routed = sum(len(sample["tokens"]) for sample in samples)
    return {name: g / routed for name, g in gather_full_tensors([model]).items()}, plans[-1]


def verl_layout(samples):
    """What verl's MTP forward gives the model: labels = the next token (the last wraps to the
    first), loss mask rolled one place with them (the last takes the first entry's 0)."""
    return [
        {
            "tokens": s["tokens"],
            "labels": torch.roll(s["tokens"], -1),
            "loss_mask": torch.roll(s["loss_mask"], -1),
        }
        for s in samples
    ]


def one_microbatch_reference(rank: int, world_size: int, samples, depth: int):
    """megatron's rule on the whole batch as one micro-batch, no CP: gradients over the
    loss-token count (verl's sft_loss is a token mean)."""
    init_megatron(seed=OPTIONS.seed)
    (model,) = build_tiny_gpt(options=options(depth))
    _, num_tokens = packed_loss_and_backward(model, verl_layout(samples))
    return {name: g / num_tokens for name, g in gather_full_tensors([model]).items()}


def plan_of(budget: int) -> list:
    scheduler = DefaultDynamicCPScheduler(
        max_seqlen_per_dp_cp_rank=budget, cp_size=CP, dp_size=WORLD // CP
    )
    return scheduler.get_groups_and_subsamples(list(enumerate(LENGTHS)))


@pytest.fixture(scope="module")
def samples():
    samples = make_samples(LENGTHS, OPTIONS.vocab_size, seed=3)
    for sample in samples:  # a prompt token first: verl's rolled mask wraps to it
        sample["loss_mask"][0] = 0
    # Samples whose second token carries loss: the global ratio N / N_1 is not 1.
    assert sum(float(s["loss_mask"][1]) for s in samples) > 0
    return samples


def assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and any(name.startswith("mtp.") for name in want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "depth, budgets, tp",
    [(1, BUDGETS, 1), (2, BUDGETS[:1], 1), (1, BUDGETS[1:], 2)],
    ids=["d1", "d2", "d1-tp2"],
)
def test_mtp_gradients_under_verl_are_packing_independent(samples, depth, budgets, tp):
    """Two plans of one batch (different micro-batches and CP sizes), each on every rank: the
    full gradients, MTP layers included, equal megatron's rule on one micro-batch. At TP 2:
    8 ranks, TP 2 × DP×CP 4 (verl's 2·TP·CP padding)."""
    assert plan_of(BUDGETS[0]) != plan_of(BUDGETS[1])
    (reference,) = run_distributed(one_microbatch_reference, 1, samples, depth, timeout_s=TIMEOUT_S)
    for budget in budgets:
        step = partial(engine_train, budget=budget, depth=depth, rule="global", tp=tp)
        results = run_distributed(step, WORLD * tp, samples, timeout_s=TIMEOUT_S)
        assert_covers([ran for _, ran in results], Layout(tp=tp, dp=WORLD // CP, cp=CP))
        for grads, _ in results:
            assert_grads_close(grads, reference)


def test_megatron_rule_under_verl_depends_on_the_packing(samples):
    """Without the global ratios (verl's own behaviour on megatron-core): other MTP gradients,
    so the test above would catch a path that lost them."""
    (reference,) = run_distributed(one_microbatch_reference, 1, samples, 1, timeout_s=TIMEOUT_S)
    step = partial(engine_train, budget=BUDGETS[0], depth=1, rule="megatron")
    results = run_distributed(step, WORLD, samples, timeout_s=TIMEOUT_S)
    assert_covers([ran for _, ran in results], Layout(dp=WORLD // CP, cp=CP))  # packings differ
    grads = results[0][0]
    with pytest.raises(AssertionError):
        assert_grads_close(grads, reference)


def test_counted_masks_are_verls_mtp_masks_for_response_only_loss_masks():
    """An RL batch's loss mask covers the response only: the counted masks are verl's own MTP
    mask (``_build_mtp_loss_mask_nested``: prompt zeros in front) rolled one place, as its
    ``preprocess_thd_engine(need_roll=True)`` rolls it within a sequence; only the leader's
    micro-batches count, and a batch that is not verl's is not counted."""
    from verl.models.mcore.model_forward import _build_mtp_loss_mask_nested
    from verl.utils import tensordict_utils as tu

    from megatron_dcp.integration.megatron_dev_api import replicated_batch_mtp_masks

    samples = make_samples([9, 14, 6], OPTIONS.vocab_size, seed=1)
    responses = [s["loss_mask"][-n:].clone() for s, n in zip(samples, (4, 10, 1))]
    batch = verl_batch(samples)
    batch["loss_mask"] = torch.nested.as_nested_tensor(responses, layout=torch.jagged)
    tu.assign_non_tensor_data(batch, "local_cp_size", 2)
    tu.assign_non_tensor_data(batch, "_dcp_group_leader", True)
    full = _build_mtp_loss_mask_nested(batch["loss_mask"], [9, 14, 6], None).unbind()
    got = replicated_batch_mtp_masks([batch])
    assert len(got) == 3
    for mine, theirs in zip(got, full):
        torch.testing.assert_close(mine, torch.roll(theirs.double(), -1))
    tu.assign_non_tensor_data(batch, "_dcp_group_leader", False)
    assert replicated_batch_mtp_masks([batch]) == []
    assert replicated_batch_mtp_masks([{"tokens": samples[0]["tokens"]}]) is None
