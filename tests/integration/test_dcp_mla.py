"""Multi-latent attention (MLA, DeepSeek-V3's attention) under DCP equals the single-process run:
loss, token count and every gradient, on CPU with megatron's local MLA modules and the reference
attention (``testing.mla``: Q/K heads of 24 channels, V heads of 12, YaRN RoPE on the 8 decoupled
positional channels, MLA's own softmax scale).

MLA applies RoPE itself, over ``pg_collection.cp``, and asserts that micro-batches carry no
``local_cp_size``; the ``mla_rope`` patch runs that on each micro-batch's CP group. The layouts:

- dp4·cp1: a static CP size of 1, so DCP's groups of 2 and 4 are larger than megatron's (MLA
  would cut its rotary table to the local token count there), direct query projection;
- tp2·cp4 with sequence parallelism (8 ranks), and tp2·cp2 without: low-rank query with q/kv
  norms, and the local spec's column-parallel down projection (the
  ``mla_local_kv_down_projection`` patch, one branch each);
- MLA with MoE (expert parallelism 2) and an MTP layer at dp2·cp2: the DeepSeek-V3 shape. The
  reference is one packed micro-batch without CP (megatron weighs MTP by a micro-batch's own
  token ratio; DCP by the global batch's: ``test_mtp_oracle.py``).

With budget 64 on 4 DP×CP positions: 200 tokens need all four, 120 and 71 two; the planner packs
the short samples into groups of two as well (asserted: groups of 2 and 4 in every plan).
"""

import dataclasses
from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend only without CUDA"),
]

from megatron_dcp.testing.dcp_step import dcp_training_step  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    ReferenceResult,
    TinyGPTOptions,
    init_megatron,
    make_samples,
    packed_loss_and_backward,
    reference_passes,
    single_process_reference,
)
from megatron_dcp.testing.mla import MLA_FIELDS  # noqa: E402
from megatron_dcp.testing.oracle import assert_step_matches  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
DIRECT_QUERY = TinyGPTOptions(multi_latent_attention=True)
LOW_RANK_QUERY = dataclasses.replace(DIRECT_QUERY, q_lora_rank=48)
DEEPSEEK_V3 = dataclasses.replace(
    LOW_RANK_QUERY,
    add_bias_linear=False,  # megatron's SequentialMLP experts fail with linear biases
    num_moe_experts=4,
    moe_router_topk=2,
    expert_parallel=2,
    mtp_layers=1,
)
LOW_RANK_QUERY_SP = dataclasses.replace(LOW_RANK_QUERY, sequence_parallel=True)
HEADS = TinyGPTOptions().num_attention_heads


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, seed=7)


def assert_mla_layers(grads: dict, options: TinyGPTOptions, prefix="decoder.layers.0") -> None:
    """The model trained MLA layers of the asked shape: their projections' full weights."""
    mla, hidden = MLA_FIELDS, options.hidden_size
    query = mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"]
    latent, key_value = mla["kv_lora_rank"], mla["qk_head_dim"] + mla["v_head_dim"]
    expected = {
        "linear_kv_down_proj": (latent + mla["qk_pos_emb_head_dim"], hidden),
        "linear_kv_up_proj": (HEADS * key_value, latent),
        "linear_proj": (hidden, HEADS * mla["v_head_dim"]),
    }
    if options.q_lora_rank is None:
        expected["linear_q_proj"] = (HEADS * query, hidden)
    else:
        expected["linear_q_down_proj"] = (options.q_lora_rank, hidden)
        expected["linear_q_up_proj"] = (HEADS * query, options.q_lora_rank)
        expected["q_layernorm"] = (options.q_lora_rank,)
        expected["kv_layernorm"] = (latent,)
    attention = f"{prefix}.self_attention."
    shapes = {
        name[len(attention) :].rsplit(".", 1)[0]: tuple(grad.shape)
        for name, grad in grads.items()
        if name.startswith(attention) and name.endswith(".weight")
    }
    assert shapes == expected


@pytest.mark.parametrize(
    "layout,options,budget,sizes",
    [
        (Layout(dp=4, cp=1), DIRECT_QUERY, 64, {2, 4}),
        (Layout(tp=2, cp=4), LOW_RANK_QUERY_SP, 64, {2, 4}),
        (Layout(tp=2, cp=2), LOW_RANK_QUERY, 100, {1, 2}),  # TP without sequence parallelism
    ],
    ids=["dp4cp1-direct-query", "tp2cp4-sp-low-rank-query", "tp2cp2-low-rank-query"],
)
def test_mla_equals_single_process_with_mixed_cp_sizes(samples, layout, options, budget, sizes):
    single = dataclasses.replace(options, sequence_parallel=False)
    reference = single_process_reference(samples, single)
    step = partial(dcp_training_step, tp=layout.tp, cp=layout.cp, budget=budget, options=options)
    world = layout.tp * layout.dp * layout.cp
    results = run_distributed(step, world, samples, timeout_s=240)
    assert_covers(results, layout, mix_of=sizes)
    for result in results:
        assert_step_matches(result, reference)
    assert_mla_layers(results[0].grads, options)


def one_microbatch_reference(rank: int, world_size: int, samples, options) -> ReferenceResult:
    """The whole batch as one packed micro-batch, one process, no CP, no expert parallelism."""
    init_megatron(seed=options.seed)
    single = dataclasses.replace(options, expert_parallel=1)
    return reference_passes(samples, single, run=packed_loss_and_backward)


def test_mla_with_moe_and_mtp_equals_single_process(samples):
    """The DeepSeek-V3 shape: MLA, MoE layers (EP 2, top-2 routing) and one MTP layer, whose
    own MLA layer runs on the micro-batch's CP group too."""
    (reference,) = run_distributed(
        one_microbatch_reference, 1, samples, DEEPSEEK_V3, timeout_s=240
    )
    step = partial(dcp_training_step, cp=2, budget=64, options=DEEPSEEK_V3)
    results = run_distributed(step, 4, samples, timeout_s=240)
    assert_covers(results, Layout(dp=2, cp=2), mix_of={2, 4})
    for result in results:
        assert_step_matches(result, reference)
    grads = results[0].grads
    assert_mla_layers(grads, DEEPSEEK_V3, prefix="mtp.layers.0.mtp_model_layer")
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in grads
