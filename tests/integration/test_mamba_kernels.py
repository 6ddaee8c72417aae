"""The reference Mamba kernels (``integration.cpu.mamba_kernels``) against a naive per-token
recurrence written here, forward and gradients (float64), and packing: a packed batch with
``seq_idx`` equals each sequence run alone."""

import pytest
import torch
import torch.nn.functional as F

from megatron_dcp.integration.cpu.mamba_kernels import (
    RMSNormGated,
    causal_conv1d_fn,
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
)


pytestmark = pytest.mark.usefixtures("float64")  # tests/integration/conftest.py


def naive_conv(x, weight, bias, lengths, silu):
    """Per sequence, per output position, an explicit sum over the window."""
    out, start = torch.zeros_like(x), 0
    for length in lengths:
        for t in range(start, start + length):
            for tap in range(weight.shape[1]):
                source = t - (weight.shape[1] - 1) + tap
                if source >= start:
                    out[:, :, t] = out[:, :, t] + weight[:, tap] * x[:, :, source]
            if bias is not None:
                out[:, :, t] = out[:, :, t] + bias
        start += length
    return F.silu(out) if silu else out


def naive_scan(x, dt, A, B, C, D, lengths):
    """h_t = exp(dt_t·A)·h_{t-1} + dt_t·x_t·B_tᵀ, y_t = h_t·C_t + D·x_t per head (B, C of the
    head's group); the state restarts at each sequence. x: (1, L, H, P); B, C: (1, L, G, N)."""
    heads, groups = x.shape[2], B.shape[2]
    outputs, start = [], 0
    for length in lengths:
        states = [torch.zeros(x.shape[3], B.shape[3]) for _ in range(heads)]
        for t in range(start, start + length):
            row = []
            for h in range(heads):
                g = h // (heads // groups)
                decay = torch.exp(dt[0, t, h] * A[h])
                states[h] = decay * states[h] + dt[0, t, h] * torch.outer(x[0, t, h], B[0, t, g])
                row.append(states[h] @ C[0, t, g] + D[h] * x[0, t, h])
            outputs.append(torch.stack(row))
        start += length
    return torch.stack(outputs).unsqueeze(0)


def seq_idx_of(lengths):
    return (
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(1, -1).int()
    )


def scan_inputs(lengths, heads=4, headdim=3, groups=2, state=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    rand = lambda *shape: torch.randn(*shape, generator=gen).requires_grad_()  # noqa: E731
    return dict(
        x=rand(1, total, heads, headdim),
        dt=(0.5 * torch.rand(1, total, heads, generator=gen)).requires_grad_(),
        A=(-torch.rand(heads, generator=gen) - 0.1).requires_grad_(),
        B=rand(1, total, groups, state),
        C=rand(1, total, groups, state),
        D=rand(heads),
    )


def grads(output, inputs):
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(9))
    return torch.autograd.grad((output * weights).sum(), list(inputs))


# (lengths, chunk size): boundaries inside a chunk, length-1 sequences, a chunk size that does not
# divide the length, one sequence.
CASES = [((5, 1, 7), 4), ((1, 1, 3, 1), 2), ((9,), 4), ((3, 6, 2), 5)]


@pytest.mark.parametrize("lengths,chunk", CASES)
def test_scan_equals_the_recurrence(lengths, chunk):
    inputs = scan_inputs(lengths)
    x, dt, A, B, C, D = inputs.values()
    seq_idx = seq_idx_of(lengths) if len(lengths) > 1 else None
    ours = mamba_chunk_scan_combined(x, dt, A, B, C, chunk, D=D, seq_idx=seq_idx)
    expected = naive_scan(x, dt, A, B, C, D, lengths)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-9)
    for a, b in zip(grads(ours, inputs.values()), grads(expected, inputs.values())):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("lengths", [(5, 1, 7), (2, 2, 2, 3)])
def test_conv_equals_the_window_sum(lengths):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, sum(lengths), generator=gen).requires_grad_()
    weight = torch.randn(6, 4, generator=gen).requires_grad_()
    bias = torch.randn(6, generator=gen).requires_grad_()
    ours = causal_conv1d_fn(x, weight, bias, seq_idx_of(lengths), activation="silu")
    expected = naive_conv(x, weight, bias, lengths, silu=True)
    torch.testing.assert_close(ours, expected)
    for a, b in zip(grads(ours, (x, weight, bias)), grads(expected, (x, weight, bias))):
        torch.testing.assert_close(a, b)


def test_gated_norm_per_group():
    gen = torch.Generator().manual_seed(2)
    x, z = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    norm = RMSNormGated(8, eps=1e-5, group_size=4, norm_before_gate=False)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=gen))
    gated = (x * F.silu(z)).view(2, 3, 2, 4)
    expected = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x, z), expected.view(2, 3, 8) * norm.weight)


def split_inputs(lengths, heads=4, headdim=2, groups=2, state=3, seed=3):
    gen = torch.Generator().manual_seed(seed)
    dim, conv = heads * headdim, heads * headdim + 2 * groups * state
    rand = lambda *shape: torch.randn(*shape, generator=gen).requires_grad_()  # noqa: E731
    return dict(
        zxbcdt=rand(1, sum(lengths), dim + conv + heads),
        conv1d_weight=rand(conv, 4),
        conv1d_bias=rand(conv),
        dt_bias=rand(heads),
        A=(-torch.rand(heads, generator=gen) - 0.1).requires_grad_(),
        D=rand(heads),
    )


@pytest.mark.parametrize("rmsnorm", [False, True])
def test_packed_split_scan_equals_each_sequence_alone(rmsnorm):
    """The fused kernel on three packed sequences equals each sequence run alone, forward and
    every gradient: no conv context and no SSM state crosses a boundary."""
    lengths = (6, 1, 9)
    inputs = split_inputs(lengths)
    extra = dict(headdim=2, ngroups=2, norm_before_gate=False)
    if rmsnorm:
        extra["rmsnorm_weight"] = torch.randn(8, generator=torch.Generator().manual_seed(4))
    packed = mamba_split_conv1d_scan_combined(
        *inputs.values(), chunk_size=4, seq_idx=seq_idx_of(lengths), **extra
    )
    pieces = torch.split(inputs["zxbcdt"], lengths, dim=1)
    rest = list(inputs.values())[1:]
    alone = torch.cat(
        [mamba_split_conv1d_scan_combined(p, *rest, chunk_size=4, **extra) for p in pieces], dim=1
    )
    torch.testing.assert_close(packed, alone)
    for a, b in zip(grads(packed, inputs.values()), grads(alone, inputs.values())):
        torch.testing.assert_close(a, b)


def test_split_scan_without_seq_idx_mixes_the_sequences():
    """The packing test above can fail: without seq_idx the sequences leak into each other."""
    lengths = (6, 1, 9)
    inputs = split_inputs(lengths)
    packed = mamba_split_conv1d_scan_combined(*inputs.values(), chunk_size=4, headdim=2, ngroups=2)
    first = mamba_split_conv1d_scan_combined(
        inputs["zxbcdt"][:, :6], *list(inputs.values())[1:], chunk_size=4, headdim=2, ngroups=2
    )
    torch.testing.assert_close(packed[:, :6], first)
    assert not torch.allclose(
        packed[:, 6:7],
        mamba_split_conv1d_scan_combined(
            inputs["zxbcdt"][:, 6:7], *list(inputs.values())[1:], chunk_size=4, headdim=2, ngroups=2
        ),
    )
