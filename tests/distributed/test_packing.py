"""THD packing and zigzag slicing: every real token lands on exactly one rank of the group, at the
right position; padding carries no loss; cu_seqlens are global; unzigzag inverts the slicing."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_dcp.runtime.packing import (
    pack_samples,
    padded_length,
    padding_multiple,
    unzigzag,
    zigzag_slice,
)


def _sample(length: int, offset: int = 0) -> dict[str, torch.Tensor]:
    """Tokens are unique across samples (offset + 1 ...), so tests can track each one."""
    tokens = torch.arange(offset + 1, offset + length + 1)
    return {"tokens": tokens, "labels": tokens + 1000, "loss_mask": torch.ones(length)}


def _samples(lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return [_sample(n, o) for n, o in zip(lengths, offsets)]


def _pack_group(lengths: list[int], cp_size: int, pad_multiple: int):
    samples = _samples(lengths)
    return [pack_samples(samples, cp_size, rank, pad_multiple) for rank in range(cp_size)]


def test_padding_multiple():
    assert padding_multiple(1) == 1
    assert padding_multiple(4) == 8
    assert padding_multiple(4, tp_size=2) == 8
    assert padding_multiple(4, tp_size=2, sequence_parallel=True) == 16
    assert padding_multiple(1, tp_size=2, sequence_parallel=True) == 2
    with pytest.raises(ValueError):
        padding_multiple(0)


def test_zigzag_layout_of_one_sequence():
    """cp 2, one sequence of 8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    rank0, rank1 = _pack_group([8], cp_size=2, pad_multiple=4)
    assert rank0.tokens.tolist() == [[1, 2, 7, 8]]
    assert rank1.tokens.tolist() == [[3, 4, 5, 6]]
    assert rank0.position_ids.tolist() == [[0, 1, 6, 7]]
    assert rank1.position_ids.tolist() == [[2, 3, 4, 5]]


def test_padding_and_cu_seqlens():
    (packed,) = _pack_group([3, 6], cp_size=1, pad_multiple=4)
    assert packed.cu_seqlens.tolist() == [0, 3, 9]
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert packed.cu_seqlens.dtype == packed.cu_seqlens_padded.dtype == torch.int32
    assert packed.max_seqlen == 8
    assert packed.tokens.tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 0, 0]]
    assert packed.labels[0, 3].item() == 0 and packed.loss_mask[0, 3].item() == 0
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert packed.num_tokens == 9


def test_given_position_ids_are_kept_and_padding_continues():
    sample = dict(_sample(3), position_ids=torch.tensor([5, 6, 7]))
    packed = pack_samples([sample], cp_size=1, cp_rank=0, pad_multiple=4)
    assert packed.position_ids.tolist() == [[5, 6, 7, 3]]


def test_zero_length_samples_are_dropped():
    packed = pack_samples(_samples([0, 5, 0]), cp_size=2, cp_rank=0, pad_multiple=4)
    assert packed.cu_seqlens.tolist() == [0, 5]
    assert packed.cu_seqlens_padded.tolist() == [0, 8]


@pytest.mark.parametrize("lengths", [[], [0, 0]])
def test_empty_group_packs_one_loss_free_padding_sequence(lengths):
    ranks = _pack_group(lengths, cp_size=2, pad_multiple=4)
    for packed in ranks:
        assert packed.num_local_tokens == 2 and packed.num_tokens == 0
        assert packed.loss_mask.sum().item() == 0
        assert packed.cu_seqlens.tolist() == [0, 0]
        assert packed.cu_seqlens_padded.tolist() == [0, 4]


def test_invalid_arguments_name_the_fix():
    with pytest.raises(ValueError, match="padding_multiple"):
        pack_samples(_samples([4]), cp_size=2, cp_rank=0, pad_multiple=2)
    with pytest.raises(ValueError, match="cp_rank"):
        pack_samples(_samples([4]), cp_size=2, cp_rank=2, pad_multiple=4)
    with pytest.raises(ValueError, match="differ in length"):
        pack_samples([dict(_sample(4), labels=torch.zeros(3))], 1, 0, 1)


@given(
    lengths=st.lists(st.integers(0, 40), max_size=6),
    log_cp=st.integers(0, 3),
    tp=st.sampled_from([1, 2]),
    sequence_parallel=st.booleans(),
)
def test_every_real_token_once_and_unzigzag_inverts(lengths, log_cp, tp, sequence_parallel):
    cp_size = 2**log_cp
    multiple = padding_multiple(cp_size, tp, sequence_parallel)
    ranks = _pack_group(lengths, cp_size, multiple)
    _check_token_coverage(ranks, lengths)
    _check_cu_seqlens(ranks, lengths, multiple)
    _check_unzigzag(ranks)
    for packed in ranks:
        assert packed.num_local_tokens % (tp if sequence_parallel else 1) == 0
        assert (packed.loss_mask[packed.tokens == 0] == 0).all()  # padding carries no loss
        assert (packed.labels[packed.tokens == 0] == 0).all()


def _check_token_coverage(ranks, lengths):
    """Each real token exactly once over the group, with its position in its sequence."""
    seen = torch.cat([packed.tokens[0] for packed in ranks])
    real = seen[seen != 0]
    assert sorted(real.tolist()) == list(range(1, sum(lengths) + 1))
    starts = {sum(lengths[:i]) + 1: i for i, n in enumerate(lengths) if n}
    for packed in ranks:
        for token, position in zip(packed.tokens[0].tolist(), packed.position_ids[0].tolist()):
            if token:
                start = max(s for s in starts if s <= token)
                assert position == token - start
    assert sum(packed.num_tokens for packed in ranks) == sum(lengths)


def _check_cu_seqlens(ranks, lengths, multiple):
    real = [n for n in lengths if n] or [0]
    padded = [padded_length(n, multiple) for n in real] if any(real) else [multiple]
    for packed in ranks:
        assert packed.cu_seqlens.tolist() == [sum(real[:i]) for i in range(len(real) + 1)]
        assert packed.cu_seqlens_padded.tolist() == [
            sum(padded[:i]) for i in range(len(padded) + 1)
        ]
        assert packed.max_seqlen == max(padded)
        assert packed.num_local_tokens * len(ranks) == sum(padded)


def _check_unzigzag(ranks):
    """unzigzag of the shares is the padded packed sequence; zigzag_slice gives the shares back."""
    cu_padded = ranks[0].cu_seqlens_padded
    full = unzigzag([packed.tokens[0] for packed in ranks], cu_padded)
    whole = _expected_global_tokens(full, ranks)
    assert torch.equal(full, whole)
    for rank, packed in enumerate(ranks):
        assert torch.equal(zigzag_slice(full, cu_padded, len(ranks), rank), packed.tokens[0])


def _expected_global_tokens(full, ranks):
    """The expected global layout: each sequence's real tokens, then zeros up to its padded end."""
    cu_real, cu_padded = ranks[0].cu_seqlens.tolist(), ranks[0].cu_seqlens_padded.tolist()
    expected = torch.zeros_like(full)
    for i in range(len(cu_real) - 1):
        real = cu_real[i + 1] - cu_real[i]
        first = cu_real[i] + 1
        expected[cu_padded[i] : cu_padded[i] + real] = torch.arange(first, first + real)
    return expected
