"""The reference Gated DeltaNet kernels (``integration.cpu.gdn_kernels``) against a direct
per-sequence, per-head computation of the recurrence written here (float64, forward and
gradients, with the state carried over chunk boundaries), packing (a packed batch with
``cu_seqlens`` equals each sequence alone, and without it does not), and megatron's own chunked
``torch_chunk_gated_delta_rule`` on one unpacked sequence."""

import pytest
import torch
import torch.nn.functional as F

from megatron_dcp.integration.cpu import gdn_kernels
from megatron_dcp.integration.cpu.gdn_kernels import causal_conv1d, chunk_gated_delta_rule, l2norm
from megatron_dcp.integration.megatron_import import import_megatron_core

pytestmark = pytest.mark.usefixtures("float64")  # tests/integration/conftest.py

LENGTHS = ([7, 1, 12], [20])
HEADS, KEY_DIM, VALUE_DIM, WIDTH = 2, 3, 4, 4


def naive_delta_rule(q, k, v, g, beta, lengths, scale):
    """Per sequence and head: S ← exp(g)·S; S ← S + β·k·(v − Sᵀk)ᵀ; o = scale·Sᵀq, S from zero.
    q, k: (1, L, H, K); v: (1, L, H, V); g, beta: (1, L, H)."""
    rows, start = [], 0
    for length in lengths:
        states = [torch.zeros(q.shape[-1], v.shape[-1]) for _ in range(q.shape[2])]
        for t in range(start, start + length):
            row = []
            for h in range(q.shape[2]):
                state = torch.exp(g[0, t, h]) * states[h]
                error = v[0, t, h] - state.T @ k[0, t, h]
                states[h] = state + beta[0, t, h] * torch.outer(k[0, t, h], error)
                row.append(scale * states[h].T @ q[0, t, h])
            rows.append(torch.stack(row))
        start += length
    return torch.stack(rows).unsqueeze(0)


def naive_conv(x, weight, bias, lengths):
    """SiLU of an explicit window sum per sequence; x: (1, L, D), weight: (D, W)."""
    out, start = torch.zeros_like(x), 0
    for length in lengths:
        for t in range(start, start + length):
            for tap in range(weight.shape[1]):
                source = t - (weight.shape[1] - 1) + tap
                if source >= start:
                    out[0, t] = out[0, t] + weight[:, tap] * x[0, source]
            out[0, t] = out[0, t] + bias
        start += length
    return F.silu(out)


def cu_seqlens_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def delta_rule_inputs(length, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    q, k = draw(1, length, HEADS, KEY_DIM), draw(1, length, HEADS, KEY_DIM)
    v = draw(1, length, HEADS, VALUE_DIM)
    g = (-torch.rand(1, length, HEADS, generator=generator)).requires_grad_()
    beta = torch.rand(1, length, HEADS, generator=generator).requires_grad_()
    return q, k, v, g, beta


def grads_of(out, inputs):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    return torch.autograd.grad((out * weights).sum(), inputs, retain_graph=True)


@pytest.mark.parametrize("chunk", [64, 3])  # one chunk per sequence; state carried across chunks
@pytest.mark.parametrize("lengths", LENGTHS)
def test_delta_rule_equals_the_recurrence_per_sequence(lengths, chunk, monkeypatch):
    monkeypatch.setattr(gdn_kernels, "CHUNK", chunk)
    inputs = delta_rule_inputs(sum(lengths))
    q, k = l2norm(inputs[0]), l2norm(inputs[1])  # as megatron feeds it: unit keys
    out, final = chunk_gated_delta_rule(q, k, *inputs[2:], cu_seqlens=cu_seqlens_of(lengths))
    expected = naive_delta_rule(q, k, *inputs[2:], lengths, KEY_DIM**-0.5)
    assert final is None and out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads_of(out, inputs), grads_of(expected, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_packed_delta_rule_equals_each_sequence_alone_and_needs_cu_seqlens():
    lengths = LENGTHS[0]
    inputs = delta_rule_inputs(sum(lengths))
    packed, _ = chunk_gated_delta_rule(*inputs, scale=0.7, cu_seqlens=cu_seqlens_of(lengths))
    alone, start = [], 0
    for length in lengths:
        part = [x[:, start : start + length] for x in inputs]
        alone.append(chunk_gated_delta_rule(*part, scale=0.7)[0])
        start += length
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-13)
    unpacked, _ = chunk_gated_delta_rule(*inputs, scale=0.7)
    assert not torch.allclose(unpacked, packed)


@pytest.mark.parametrize("lengths", LENGTHS)
def test_conv_equals_the_window_sum_per_sequence(lengths):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(lengths), 5, generator=generator).requires_grad_()
    weight = torch.randn(5, WIDTH, generator=generator).requires_grad_()
    bias = torch.randn(5, generator=generator).requires_grad_()
    out, final = causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=cu_seqlens_of(lengths))
    expected = naive_conv(x, weight, bias, lengths)
    assert final is None
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads_of(out, (x, weight, bias)), grads_of(expected, (x, weight, bias))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if len(lengths) > 1:  # without cu_seqlens, windows cross the sequence boundaries
        crossing, _ = causal_conv1d(x, weight, bias, activation="silu")
        assert not torch.allclose(crossing, out)


def test_l2norm_makes_unit_vectors_and_keeps_the_dtype():
    x = torch.randn(3, 4, 8, dtype=torch.float32)
    out = l2norm(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(3, 4, dtype=torch.float32))
    torch.testing.assert_close(l2norm(x.double(), eps=0.0), x.double() / x.double().norm(dim=-1, keepdim=True))


@pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
def test_delta_rule_equals_megatrons_chunked_torch_version():
    """megatron's deterministic-mode kernel (chunks of 64, its own WY form), float32, on one
    unpacked sequence that spans three chunks."""
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    q, k, v, g, beta = (x.detach().float() for x in delta_rule_inputs(150, seed=3))
    q, k = l2norm(q), l2norm(k)
    ours, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    theirs, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
