"""verl 0.9.1's Megatron engine start-up on megatron_dcp's upstream API (gloo, CPU): the engine's
own ``_init_device_mesh`` (it checks that ``initialize_model_parallel`` has the
``dynamic_context_parallel`` keyword, then passes it), a reference-model engine in the same
process (it checks the dynamic groups exist), and the engine's data-parallel group under DCP (the
one-rank group: a replicated batch is one data-parallel replica, so verl's token-count
all-reduce over it is the identity). The engine methods are called on a stand-in ``self`` that
holds only the config they read: building a whole ``MegatronEngine`` needs a model bridge and
HF weights."""

from types import SimpleNamespace

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import MegatronEngine  # noqa: E402

import megatron_dcp  # noqa: E402
from megatron_dcp.integration.patches import enable_cpu_backend  # noqa: E402

TIMEOUT_S = 120


def engine(cp: int, dynamic: bool = True) -> SimpleNamespace:
    """The part of a verl engine ``_init_device_mesh`` and the DP helpers read."""
    config = SimpleNamespace(
        dynamic_context_parallel=dynamic,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=cp,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=None,
    )
    return SimpleNamespace(engine_config=config)


def actor_and_reference(rank: int, world_size: int, cp: int) -> dict:
    from megatron.core import parallel_state

    enable_cpu_backend()
    megatron_dcp.install_upstream_api()
    actor, reference = engine(cp), engine(cp)
    MegatronEngine._init_device_mesh(actor)  # initialises megatron, dynamic groups included
    MegatronEngine._init_device_mesh(reference)  # finds them: no error
    group = MegatronEngine.get_data_parallel_group(actor)
    count = torch.tensor([7.0])
    dist.all_reduce(count, group=group)
    return {
        "cp": parallel_state.get_context_parallel_world_size(),
        "dp size": MegatronEngine.get_data_parallel_size(actor),
        "dp group": tuple(dist.get_process_group_ranks(group)),
        "count": count.item(),
    }


def test_actor_and_reference_engines_start_on_dynamic_groups():
    results = run_distributed(actor_and_reference, 4, 2, timeout_s=TIMEOUT_S)
    for rank, result in enumerate(results):
        assert result["cp"] == 2 and result["dp size"] == 1
        assert result["dp group"] == (rank,)
        assert result["count"] == 7.0  # verl #5983: no sum over ranks holding the same batch


def reference_after_static_init(rank: int, world_size: int) -> str:
    """An engine initialised megatron without dynamic groups; a DCP engine then refuses."""
    from megatron.core import parallel_state

    enable_cpu_backend()
    megatron_dcp.install_upstream_api()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    with pytest.raises(RuntimeError) as error:
        MegatronEngine._init_device_mesh(engine(2))
    return str(error.value)


def test_a_dcp_engine_after_a_static_one_gets_verls_error():
    messages = run_distributed(reference_after_static_init, 4, timeout_s=TIMEOUT_S)
    assert all("without dynamic DPxCP groups" in message for message in messages)


def test_verl_loads_the_plugin_from_its_external_modules_variable():
    """``VERL_USE_EXTERNAL_MODULES=megatron_dcp.verl_plugin``: ``import verl`` installs the API."""
    import os
    import subprocess
    import sys

    code = (
        "import verl\n"
        "from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler as S\n"
        "print(S.__module__)\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "megatron_dcp.verl_plugin"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("megatron_dcp.integration.upstream")
