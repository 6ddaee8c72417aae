"""On GPUs: multi-latent attention under DCP through Transformer Engine equals the reference.

megatron's ``MLASelfAttention`` from its Transformer Engine layer spec (TE linears and norms,
``TEDotProductAttention``), with ``apply_patches()``, against the same layer with
``ReferenceCoreAttention`` as core attention and the same weights. Both run the packed THD
micro-batches of ``test_te_attention.py`` (one per DCP group size of the domain, one mixing a
large group with groups of one, then a static-CP micro-batch), with unfused and fused (Triton)
YaRN RoPE. What this checks on the GPU path, reasoned on CPU (``docs/runtime.md``):

- the ``mla_rope`` entry: MLA's RoPE on the decoupled positional channels (fused: ``cp_rank`` /
  ``cp_size`` of ``pg_collection.cp``) runs on the micro-batch's group, past the upstream
  ``local_cp_size`` assertion; a wrong group gives wrong positions or a shape error;
- the THD value padding: MLA pads V (32 channels here) to Q/K's head dimension (64) before
  TE and trims the output; the reference takes either;
- the ``te_attention`` entry: TE's CP group is the micro-batch's, restored for the static one.

Both layers share everything but the core attention, so only the attention and the RoPE
inputs it sees can differ. Compared on real tokens: the layer output and the gradient of its
input hidden states, with ``test_te_attention.py``'s bf16 tolerances. Layouts with TP 1 (TP
changes only which heads a rank holds; the layers' TP paths are the same on both sides).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_te_attention import (
    GPUS,
    GRAD_RMS,
    GRAD_TOL,
    HAVE_TE,
    OUTPUT_RMS,
    OUTPUT_TOL,
    Layout,
    MicroBatch,
    assert_bf16_close,
    dcp_micro_batches,
    device,
    domain_of,
    real_rows,
    static_micro_batch,
)

from megatron_dcp.runtime.packing import zigzag_slice
from megatron_dcp.tools.launching.local_ranks import run_distributed

HAVE_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        GPUS == 0 or not HAVE_TE,
        reason="needs a CUDA GPU and transformer_engine (MLA through TE vs the reference); "
        f"found {GPUS} GPUs, transformer_engine {'installed' if HAVE_TE else 'not installed'}",
    ),
]

HIDDEN, HEADS = 256, 8
MLA_SHAPE = dict(q_lora_rank=64, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=32)
V_HEAD_DIM = 32  # Q/K heads have 64 channels: MLA pads V to 64 on THD
LAYOUTS = [
    Layout(cp=2, world=2),  # dp1·cp2: groups 1 and 2
    Layout(cp=1, world=2),  # dp2·cp1: a static CP size of 1, DCP groups of 2
    Layout(cp=2, world=4),  # dp2·cp2: groups 1, 2, 4
    Layout(cp=4, world=8),  # dp2·cp4: groups up to 8
]


def mla_config(layout: Layout, fused_rope: bool):
    """One bf16 MLA layer's config (YaRN RoPE, q/kv norms, no dropout)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        v_head_dim=V_HEAD_DIM,
        qk_layernorm=True,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=64,
        mscale_all_dim=1.0,
        apply_rope_fusion=fused_rope,
        context_parallel_size=layout.cp,
        pipeline_dtype=torch.bfloat16,
        params_dtype=torch.bfloat16,
        bf16=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **MLA_SHAPE,
    )


def build_pair(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The TE-spec MLA layer and its twin with the reference core attention, same weights."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_submodules,
    )
    from megatron.core.transformer.spec_utils import build_module

    from megatron_dcp.integration.cpu.core_attention import with_core_attention

    spec = get_gpt_layer_with_transformer_engine_submodules(
        multi_latent_attention=True, qk_layernorm=True
    ).self_attention
    te = build_module(spec, config=config, layer_number=1).to(device())
    reference = build_module(with_core_attention(spec), config=config, layer_number=1)
    reference = reference.to(device())
    weights = dict(te.named_parameters())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(weights[name])
    return te, reference


def local_hidden(batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's zigzag share of the group's global bf16 hidden states ``[t, 1, HIDDEN]`` and
    output gradient (0 on padding rows)."""
    total = int(batch.cu_seqlens_padded[-1])
    generator = torch.Generator().manual_seed(batch.seed)
    hidden, grad = (torch.randn(total, HIDDEN, generator=generator) for _ in range(2))
    grad[~real_rows(batch.cu_seqlens_padded, batch.cu_seqlens)] = 0
    shares = [
        zigzag_slice(t, batch.cu_seqlens_padded, batch.group_size, batch.group_rank)
        for t in (hidden, grad)
    ]
    return tuple(s.unsqueeze(1).to(device=device(), dtype=torch.bfloat16) for s in shares)


def layer_forward_backward(layer, hidden, grad, params):
    """Output and input-gradient of one MLA layer call, as fp32."""
    leaf = hidden.detach().clone().requires_grad_()
    output, bias = layer(leaf, None, packed_seq_params=params)
    if bias is not None:
        output = output + bias
    output.backward(grad)
    return output.detach().float(), leaf.grad.float()


def compare(te, reference, batch: MicroBatch, where: str) -> None:
    hidden, grad = local_hidden(batch)
    te_out, te_grad = layer_forward_backward(te, hidden, grad, batch.params)
    ref_out, ref_grad = layer_forward_backward(reference, hidden, grad, batch.params)
    real = real_rows(batch.cu_seqlens_padded, batch.cu_seqlens)
    real = zigzag_slice(real, batch.cu_seqlens_padded, batch.group_size, batch.group_rank)
    real = real.to(device())
    where = f"{where} {batch.name}"
    assert_bf16_close(te_out[real], ref_out[real], OUTPUT_TOL, OUTPUT_RMS, f"{where}: output")
    assert_bf16_close(te_grad[real], ref_grad[real], GRAD_TOL, GRAD_RMS, f"{where}: d hidden")


def compare_worker(rank: int, world_size: int, layout: Layout, fused_rope: bool) -> list[int]:
    """Every micro-batch of a step, TE vs the reference; the DCP group sizes this rank ran."""
    from megatron_dcp.integration.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core import parallel_state, tensor_parallel

    from megatron_dcp.integration.patches import apply_patches
    from megatron_dcp.integration.process_groups import create_dcp_groups

    parallel_state.initialize_model_parallel(context_parallel_size=layout.cp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    apply_patches()
    te, reference = build_pair(mla_config(layout, fused_rope))
    groups = create_dcp_groups()
    batches = dcp_micro_batches(groups) + [static_micro_batch()]
    for batch in batches:
        compare(te, reference, batch, f"{layout} fused_rope={fused_rope}")
    groups.destroy()
    return [batch.group_size for batch in batches[:-1]]


@pytest.mark.parametrize("fused_rope", [False, True], ids=["unfused-rope", "fused-rope"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_mla_through_te_equals_reference(layout: Layout, fused_rope: bool) -> None:
    if layout.world > GPUS:
        pytest.skip(f"{layout} needs {layout.world} GPUs (one per rank), {GPUS} visible")
    if fused_rope and not HAVE_TRITON:
        pytest.skip("fused MLA RoPE needs triton")
    results = run_distributed(
        compare_worker, layout.world, layout, fused_rope, backend="nccl", timeout_s=600
    )
    expected = set(domain_of(layout.domain).group_sizes)
    assert {size for sizes in results for size in sizes} == expected
