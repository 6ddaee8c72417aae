"""The reference THD/CP attention: single process equals dense causal attention per sequence; CP 2
and 4 (gloo) equal the single-process result, forward and backward; GQA; sub-groups of the world."""

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.runtime.attention import causal_attention, thd_attention
from megatron_dcp.runtime.packing import padded_length, padding_multiple, unzigzag, zigzag_slice
from megatron_dcp.testing import run_distributed

HEADS, DIM = 4, 8
LENGTHS = [13, 5, 32, 1]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([sum(lengths[:i]) for i in range(len(lengths) + 1)], dtype=torch.int32)


def _layout(cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens, cu_seqlens_padded) of LENGTHS padded for cp_size."""
    multiple = padding_multiple(cp_size)
    return _cu(LENGTHS), _cu([padded_length(n, multiple) for n in LENGTHS])


def _inputs(total: int, kv_heads: int, seed: int = 0) -> list[torch.Tensor]:
    """Global q, k, v ([total, h, d]) and the output gradient ([total, h*d])."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(total, HEADS, DIM), (total, kv_heads, DIM), (total, kv_heads, DIM)]
    tensors = [torch.randn(*shape, generator=generator) for shape in shapes]
    return tensors + [torch.randn(total, HEADS * DIM, generator=generator)]


def _single_process(cp_size: int, kv_heads: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and q/k/v gradients of the unsliced packed input, no CP."""
    cu_seqlens, cu_padded = _layout(cp_size)
    q, k, v, grad = _inputs(int(cu_padded[-1]), kv_heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    output = thd_attention(*leaves, cu_padded, cu_seqlens)
    output.backward(grad)
    return output.detach(), [leaf.grad for leaf in leaves]


def test_single_process_equals_dense_causal_attention_per_sequence():
    cu_seqlens, cu_padded = _layout(cp_size=2)
    q, k, v, _ = _inputs(int(cu_padded[-1]), HEADS)
    output = thd_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), cu_padded, cu_seqlens)
    assert output.shape == (q.shape[0], 1, HEADS * DIM)
    for start, length in zip(cu_padded[:-1].tolist(), LENGTHS):
        rows = slice(start, start + length)
        dense = causal_attention(q[rows, None], k[rows, None], v[rows, None])
        torch.testing.assert_close(output[rows], dense, rtol=0, atol=1e-6)


def test_causal_attention_matches_sdpa_with_gqa():
    q, k, v = (torch.randn(7, 2, h, DIM) for h in (HEADS, 2, 2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=True
    )
    expected = expected.permute(2, 0, 1, 3).reshape(7, 2, HEADS * DIM)
    torch.testing.assert_close(causal_attention(q, k, v), expected, rtol=1e-5, atol=1e-6)


def test_padding_is_ignored_and_empty_sequences_give_zeros():
    """Padded keys change nothing for real queries; an all-padding sequence outputs zeros."""
    q, k, v, _ = _inputs(12, HEADS)
    output = thd_attention(q, k, v, _cu([8, 4]), _cu([5, 0]))
    torch.testing.assert_close(output[:5], thd_attention(q[:5], k[:5], v[:5], _cu([5])))
    assert output[8:].abs().max() == 0


def _cp_worker(rank, world_size, cp_size, kv_heads):
    """Each CP group of the world runs the same global input; returns this rank's output and
    q/k/v gradients."""
    group = _my_group(rank, world_size, cp_size)
    cp_rank = dist.get_rank(group) if group is not None else 0
    cu_seqlens, cu_padded = _layout(cp_size)
    q, k, v, grad = _inputs(int(cu_padded[-1]), kv_heads)
    local = [zigzag_slice(t, cu_padded, cp_size, cp_rank).requires_grad_() for t in (q, k, v)]
    sbhd = [t.unsqueeze(1) for t in local]
    output = thd_attention(*sbhd, cu_padded, cu_seqlens, cp_group=group).squeeze(1)
    output.backward(zigzag_slice(grad, cu_padded, cp_size, cp_rank))
    return output.detach(), [t.grad for t in local]


def _my_group(rank: int, world_size: int, cp_size: int):
    """Aligned blocks of cp_size ranks (every rank creates every group, in the same order)."""
    if cp_size == world_size:
        return dist.group.WORLD
    groups = [dist.new_group(list(range(s, s + cp_size))) for s in range(0, world_size, cp_size)]
    return groups[rank // cp_size]


@pytest.mark.parametrize(
    "world_size,cp_size,kv_heads", [(2, 2, HEADS), (4, 4, HEADS), (4, 4, 2), (4, 2, 1)]
)
def test_cp_equals_single_process_forward_and_backward(world_size, cp_size, kv_heads):
    expected_output, expected_grads = _single_process(cp_size, kv_heads)
    _, cu_padded = _layout(cp_size)
    results = run_distributed(_cp_worker, world_size, cp_size, kv_heads, timeout_s=60)
    for first in range(0, world_size, cp_size):
        group = results[first : first + cp_size]
        output = unzigzag([out for out, _ in group], cu_padded)
        torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
        for index, expected in enumerate(expected_grads):
            grad = unzigzag([grads[index] for _, grads in group], cu_padded)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


def test_layout_mismatch_is_a_clear_error():
    q, k, v, _ = _inputs(8, HEADS)
    with pytest.raises(ValueError, match="cu_seqlens_padded"):
        thd_attention(q, k, v, _cu([16]))
