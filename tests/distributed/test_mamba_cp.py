"""Mamba's context-parallel all-to-alls under per-micro-batch groups.

megatron-core's ``MambaContextParallel`` is rebuilt by the DCP patch for the micro-batch's group
(``patches.swap_mamba_context_parallel``). Its all-to-alls (``pre_conv_ssm`` / ``post_conv_ssm``,
forward and backward) must give exactly what the object built at construction for a static CP
group of the same ranks gives. The SSM and conv kernels between them need CUDA (mamba-ssm,
causal-conv1d) and the packed-THD reordering needs Transformer Engine: those are not run here.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

D_INNER, NHEADS, NGROUPS, D_STATE, LOCAL_LEN = 16, 4, 2, 4, 6
WIDTH = 2 * D_INNER + 2 * NGROUPS * D_STATE + NHEADS


def _static_mamba_cp(group):
    from megatron.core.ssm.mamba_context_parallel import MambaContextParallel

    def param(*shape):
        return torch.nn.Parameter(torch.arange(float(torch.tensor(shape).prod())).view(*shape))

    return MambaContextParallel(
        cp_group=group,
        d_inner_local_tp=D_INNER,
        nheads_local_tp=NHEADS,
        ngroups_local_tp=NGROUPS,
        d_state=D_STATE,
        conv1d_weight_cp1=param(D_INNER + 2 * NGROUPS * D_STATE, 1, 4),
        conv1d_bias_cp1=param(D_INNER + 2 * NGROUPS * D_STATE),
        conv1d_padding=3,
        dt_bias_cp1=param(NHEADS),
        A_log_cp1=param(NHEADS),
        D_cp1=param(NHEADS),
        D_has_hdim=False,
    )


def _all_to_alls(mamba_cp, rank):
    """pre_conv_ssm and post_conv_ssm on rank-seeded inputs; outputs and input gradients."""
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(LOCAL_LEN, 1, WIDTH, generator=generator, requires_grad=True)
    pre = mamba_cp.pre_conv_ssm(x)
    y = torch.randn(
        LOCAL_LEN * mamba_cp.cp_size, 1, D_INNER // mamba_cp.cp_size, generator=generator
    )
    y.requires_grad_(True)
    post = mamba_cp.post_conv_ssm(y)
    (pre.square().sum() + post.square().sum()).backward()
    return [t.detach() for t in (pre, post, x.grad, y.grad)] + [mamba_cp.get_A_log().detach()]


def _compare_dynamic_with_static(rank, world_size, size):
    from megatron_dcp.integration import patches
    from megatron_dcp.runtime.groups import DCPGroups

    static_groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world_size, size)]
    static = _static_mamba_cp(static_groups[rank // size])
    groups = DCPGroups.create([list(range(world_size))], min_cp_size=1)
    mixer = SimpleNamespace(cp=_static_mamba_cp(patches.SOLO_GROUP))  # static CP size 1
    with patches.swap_mamba_context_parallel(mixer, groups.group(size)):
        assert mixer.cp.cp_size == size
        dynamic = _all_to_alls(mixer.cp, rank)
    expected = _all_to_alls(static, rank)
    groups.destroy()
    return all(torch.equal(a, b) for a, b in zip(dynamic, expected))


@pytest.mark.parametrize("size", [2, 4])
def test_mamba_all_to_alls_match_a_static_group_of_the_same_size(size):
    assert all(run_distributed(_compare_dynamic_with_static, 4, size, timeout_s=120))
