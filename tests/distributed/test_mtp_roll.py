"""MTP's packed-sequence roll under DCP: with the patch, rolling the zigzag shards of padded THD
sequences on a CP group equals rolling each padded sequence on one rank (0.19.2 reads the local
slices at real, unpadded offsets)."""

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

LENGTHS = (5, 12, 3, 9)


def _rolled_on_cp(rank, world_size, patched):
    from megatron.core.transformer import multi_token_prediction as mtp

    from megatron_dcp.integration import patches
    from megatron_dcp.integration.forward_backward import packed_seq_params_of
    from megatron_dcp.runtime.packing import pack_samples, padding_multiple, unzigzag

    if patched:
        patches.apply_patches()
    roll = mtp.roll_tensor if patched else getattr(mtp.roll_tensor, "__wrapped__", mtp.roll_tensor)
    samples = [
        {
            "tokens": torch.arange(1, n + 1) * 100 + i,
            "labels": torch.zeros(n, dtype=torch.long),
            "loss_mask": torch.ones(n),
        }
        for i, n in enumerate(LENGTHS)
    ]
    packed = pack_samples(samples, world_size, rank, padding_multiple(world_size))
    params = packed_seq_params_of(packed, dist.group.WORLD)
    rolled, _ = roll(
        packed.tokens, shifts=-1, dims=-1, cp_group=dist.group.WORLD, packed_seq_params=params
    )
    shards = [torch.empty_like(rolled) for _ in range(world_size)]
    dist.all_gather(shards, rolled)
    full = unzigzag([s.view(-1) for s in shards], packed.cu_seqlens_padded)
    return full, packed.cu_seqlens_padded


def _expected(cu_seqlens_padded):
    pieces = []
    for i, (start, stop) in enumerate(zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:])):
        n = LENGTHS[i]
        padded = torch.zeros(int(stop - start), dtype=torch.long)
        padded[:n] = torch.arange(1, n + 1) * 100 + i
        rolled = torch.roll(padded, -1)
        rolled[-1] = 0
        pieces.append(rolled)
    return torch.cat(pieces)


@pytest.mark.parametrize("world_size", [2, 4])
def test_patched_roll_equals_per_sequence_roll(world_size):
    full, cu_padded = run_distributed(_rolled_on_cp, world_size, True)[0]
    torch.testing.assert_close(full, _expected(cu_padded))


def test_unpatched_roll_is_wrong_with_padding():
    full, cu_padded = run_distributed(_rolled_on_cp, 2, False)[0]
    assert not torch.equal(full, _expected(cu_padded))
