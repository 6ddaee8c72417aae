"""On a GPU: flash-linear-attention's kernels, which megatron's ``GatedDeltaNet`` trains with
there, equal the CPU backend's reference kernels (``integration.cpu.gdn_kernels``).

- the kernels alone, on packed THD sequences (``cu_seqlens``): fla's ``chunk_gated_delta_rule``,
  ``causal_conv1d`` and ``l2norm`` against the reference ones on the same CUDA tensors, outputs
  and input gradients;
- one ``GatedDeltaNet`` layer (the local spec DCP builds, ``apply_patches()`` on) run on a packed
  DCP micro-batch without CP (``local_cp_size=1``: the ``gdn_context_parallel`` switch runs)
  twice: with fla's kernels, as megatron calls them on a GPU, and with the reference kernels put
  in their place; output and every parameter gradient compared.

Precision: fla's Triton kernels compute in float32 with tensor-core products (TF32 on the
matrix products), the reference in exact float32: compared by the relative RMS error
(``RMS_TOL``) and the largest element-wise difference relative to the largest reference value
(``MAX_TOL``), the order of fla's own test tolerances. Runs on one GPU in a forked worker (CUDA
is not initialised in the pytest process); skipped without a GPU or without fla.
"""

from __future__ import annotations

import importlib.util
from unittest import mock

import pytest
import torch

from megatron_dcp.tools.launching.local_ranks import cuda_device_count, run_distributed

HAVE_FLA = importlib.util.find_spec("fla") is not None
GPUS = cuda_device_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        GPUS == 0 or not HAVE_FLA,
        reason="needs a CUDA GPU and flash-linear-attention (fla's GDN kernels vs the reference); "
        f"found {GPUS} GPUs, fla {'installed' if HAVE_FLA else 'not installed'}",
    ),
]

LENGTHS = (37, 1, 120, 64, 200)  # packed; 200 spans several of fla's 64-token chunks
HEADS, HEAD_DIM, WIDTH = 4, 64, 4
RMS_TOL, MAX_TOL = 5e-3, 2e-2


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.double(), want.double()
    scale = want.abs().max().clamp_min(1e-30)
    rms = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp_min(1e-30)).item()
    largest = ((got - want).abs().max() / scale).item()
    assert rms <= RMS_TOL and largest <= MAX_TOL, f"{name}: relative RMS {rms:.3g}, max {largest:.3g}"


def cu_seqlens(device: torch.device) -> torch.Tensor:
    bounds = torch.tensor([0, *LENGTHS], device=device).cumsum(0)
    return bounds.to(torch.int32)


def kernel_inputs(device: torch.device) -> list:
    generator = torch.Generator(device="cpu").manual_seed(7)
    length = sum(LENGTHS)

    def draw(*shape, fill=torch.randn):
        return fill(*shape, generator=generator).to(device).requires_grad_()

    q, k = draw(1, length, HEADS, HEAD_DIM), draw(1, length, HEADS, HEAD_DIM)
    v = draw(1, length, HEADS, HEAD_DIM)
    g = (-0.5 * torch.rand(1, length, HEADS, generator=generator)).to(device).requires_grad_()
    beta = draw(1, length, HEADS, fill=torch.rand)
    return [q, k, v, g, beta]


def run_kernels(kernels: dict, inputs: list, conv_input: list, device: torch.device) -> list:
    """Outputs and input gradients of the three kernels, as ``GatedDeltaNet`` calls them."""
    q, k, v, g, beta = inputs
    bounds = cu_seqlens(device)
    out, _ = kernels["chunk_gated_delta_rule"](
        kernels["l2norm"](q),
        kernels["l2norm"](k),
        v,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=bounds,
    )
    x, weight = conv_input
    conv, _ = kernels["causal_conv1d"](
        x=x,
        weight=weight,
        bias=None,
        activation="silu",
        initial_state=None,
        output_final_state=False,
        cu_seqlens=bounds,
    )
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device)
    loss = (out * weights).sum() + conv.pow(2).sum()
    grads = torch.autograd.grad(loss, [*inputs, *conv_input])
    return [out.detach(), conv.detach(), *grads]


def fla_kernels() -> dict:
    from fla.modules.convolution import causal_conv1d
    from fla.modules.l2norm import l2norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return dict(
        chunk_gated_delta_rule=chunk_gated_delta_rule, causal_conv1d=causal_conv1d, l2norm=l2norm
    )


def reference_kernels() -> dict:
    from megatron_dcp.integration.cpu import gdn_kernels

    names = ("chunk_gated_delta_rule", "causal_conv1d", "l2norm")
    return {name: getattr(gdn_kernels, name) for name in names}


def worker_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def kernels_worker(rank: int, world_size: int) -> None:
    device = worker_device()
    inputs = kernel_inputs(device)
    generator = torch.Generator().manual_seed(5)
    conv_input = [
        torch.randn(1, sum(LENGTHS), 96, generator=generator).to(device).requires_grad_(),
        torch.randn(96, WIDTH, generator=generator).to(device).requires_grad_(),
    ]
    fast = run_kernels(fla_kernels(), inputs, conv_input, device)
    reference = run_kernels(reference_kernels(), inputs, conv_input, device)
    names = ("delta rule output", "conv output", "dq", "dk", "dv", "dg", "dbeta", "dx", "dweight")
    for name, got, want in zip(names, fast, reference):
        assert_close(name, got, want)


def test_fla_kernels_equal_the_reference_kernels():
    run_distributed(kernels_worker, 1, backend="nccl", timeout_s=300)


def gdn_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=4,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=1,
        linear_key_head_dim=HEAD_DIM,
        linear_value_head_dim=HEAD_DIM,
        linear_num_key_heads=2,
        linear_num_value_heads=HEADS,
        linear_conv_kernel_dim=WIDTH,
        activation_func=torch.nn.functional.silu,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def layer_pass(layer, hidden: torch.Tensor, params) -> list:
    """Output and every parameter gradient of one forward-backward."""
    layer.zero_grad(set_to_none=True)
    out, _ = layer(hidden, attention_mask=None, packed_seq_params=params)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device)
    (out * weights).sum().backward()
    return [out.detach()] + [p.grad.detach().clone() for p in layer.parameters()]


def layer_worker(rank: int, world_size: int) -> list:
    from megatron_dcp.integration.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import common, gdn
    from megatron.core.transformer.spec_utils import build_module

    from megatron_dcp.integration.cpu import gdn_kernels
    from megatron_dcp.integration.cpu.gdn_layer_spec import local_gdn_module_spec
    from megatron_dcp.integration.model_parallel import init_megatron
    from megatron_dcp.integration.patches import apply_patches

    init_megatron()
    apply_patches()
    config = gdn_config()
    layer = build_module(
        local_gdn_module_spec(config),
        config=config,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    device = worker_device()
    bounds = cu_seqlens(device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        cu_seqlens_q_padded=bounds,
        cu_seqlens_kv_padded=bounds,
        max_seqlen_q=max(LENGTHS),
        max_seqlen_kv=max(LENGTHS),
        local_cp_size=1,
        cp_group=None,
    )
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(sum(LENGTHS), 1, config.hidden_size, generator=generator).to(device)
    fast = layer_pass(layer, hidden.requires_grad_(), params)
    with mock.patch.object(gdn, "causal_conv1d", gdn_kernels.causal_conv1d), mock.patch.object(
        common, "l2norm", gdn_kernels.l2norm
    ), mock.patch.object(layer, "gated_delta_rule", gdn_kernels.chunk_gated_delta_rule):
        reference = layer_pass(layer, hidden, params)
    names = ["output"] + [name for name, _ in layer.named_parameters()]
    for name, got, want in zip(names, fast, reference):
        assert_close(name, got, want)
    return names


def test_gdn_layer_with_fla_equals_the_reference_kernels():
    (names,) = run_distributed(layer_worker, 1, backend="nccl", timeout_s=300)
    assert {"in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_proj.weight"} <= set(names)
