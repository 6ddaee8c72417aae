"""The collectives megatron's sequence parallelism and distributed optimizer call, on gloo,
against a hand computation. torch 2.13's gloo implements them natively (older releases lacked
reduce-scatter), so the CPU backend replaces none of them: this test is what fails first if a
torch change takes one away or changes its slicing."""

import pytest
import torch
import torch.distributed as dist

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

WORLD = 4
CHUNK = 3


def _inputs(rank):
    """Rank r holds 100·r + [0, 1, ..., WORLD·CHUNK): a wrong slice or a missing sum shows."""
    return 100.0 * rank + torch.arange(WORLD * CHUNK, dtype=torch.float32)


def _expected_slice(rank):
    full = sum(_inputs(k) for k in range(WORLD))
    return full[rank * CHUNK : (rank + 1) * CHUNK]


REDUCE_SCATTERS = {
    "reduce_scatter_tensor": lambda out, inp, **kw: dist.reduce_scatter_tensor(out, inp, **kw),
    "_reduce_scatter_base": lambda out, inp, **kw: dist._reduce_scatter_base(out, inp, **kw),
    "reduce_scatter": lambda out, inp, **kw: dist.reduce_scatter(out, list(inp.chunk(WORLD)), **kw),
}
ALL_GATHERS = {
    "all_gather_into_tensor": lambda out, inp, **kw: dist.all_gather_into_tensor(out, inp, **kw),
    "_all_gather_base": lambda out, inp, **kw: dist._all_gather_base(out, inp, **kw),
}


def _run(call, out, inp, async_op):
    work = call(out, inp, async_op=async_op)
    if async_op:
        work.wait()
    else:
        assert work is None
    return out


def _collectives(rank, world_size, async_op):
    assert dist.get_backend() == "gloo"
    results = {}
    for name, call in REDUCE_SCATTERS.items():
        results[name] = _run(call, torch.empty(CHUNK), _inputs(rank), async_op)
    local = _inputs(rank)[:CHUNK]
    for name, call in ALL_GATHERS.items():
        results[name] = _run(call, torch.empty(WORLD * CHUNK), local, async_op)
    average = torch.empty(CHUNK)
    dist.reduce_scatter_tensor(average, _inputs(rank), op=dist.ReduceOp.AVG)
    results["average"] = average
    return results


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_gloo_reduce_scatter_and_all_gather_match_a_hand_computation(async_op):
    gathered = torch.cat([_inputs(k)[:CHUNK] for k in range(WORLD)])
    results = run_distributed(_collectives, WORLD, async_op, backend="gloo", timeout_s=60)
    for rank, result in enumerate(results):
        for name in REDUCE_SCATTERS:
            torch.testing.assert_close(result[name], _expected_slice(rank), msg=name)
        for name in ALL_GATHERS:
            torch.testing.assert_close(result[name], gathered, msg=name)
        torch.testing.assert_close(result["average"], _expected_slice(rank) / WORLD)


@pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
def test_megatron_binds_torchs_own_collectives():
    """megatron binds these functions at import time; none is a stand-in (so the test above
    covers exactly what megatron calls)."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import layers, mappings

    for module in (mappings, layers, param_and_grad_buffer):
        assert module.dist_reduce_scatter_func is dist.reduce_scatter_tensor
        assert module.dist_all_gather_func is dist.all_gather_into_tensor
