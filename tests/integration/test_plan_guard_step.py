"""The plan-consistency guard in the DCP step: when one CP rank of a DP rank reads different
samples than its CP sibling (a data pipeline bug), every rank stops in ``prepare`` with
``PlanMismatchError`` naming the global batch, before routing; nothing hangs."""

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.forward_backward import build_forward_backward  # noqa: E402
from megatron_dcp.integration.patches import apply_patches  # noqa: E402
from megatron_dcp.runtime.plan_guard import PlanMismatchError  # noqa: E402
from megatron_dcp.testing.gpt import build_tiny_gpt, init_megatron, make_samples  # noqa: E402

LENGTHS = [90, 7, 30, 64, 12, 40, 100, 3]


def prepare_with_a_diverging_rank(rank: int, world_size: int) -> str:
    from megatron.core import parallel_state

    init_megatron(cp=2)
    apply_patches()
    (model,) = build_tiny_gpt(cp=2)
    wrapper = build_forward_backward(model.config, DCPConfig.for_model(model.config, 64))
    lengths = list(LENGTHS)
    if rank == 3:  # CP rank 1 of DP rank 1: one sample longer than its sibling's
        lengths[-1] += 5
    samples = make_samples(lengths)
    share = len(samples) // parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    wrapper.prepare(make_samples(LENGTHS)[:share])  # global batch 1: every rank agrees
    try:
        wrapper.prepare(samples[dp_rank * share : (dp_rank + 1) * share])
    except PlanMismatchError as error:
        return str(error)
    finally:
        wrapper.groups.destroy()
    return "no error"


def test_a_cp_rank_with_different_samples_stops_every_rank():
    messages = run_distributed(prepare_with_a_diverging_rank, 4, timeout_s=60)
    for message in messages:
        assert message.startswith("DCP plan mismatch in global batch 2")
        # The lengths travel over the DP group of CP rank 1 (ranks 1 and 3): both plan with them.
        assert "ranks [1, 3] do not hold the plan of ranks [0, 2]" in message
