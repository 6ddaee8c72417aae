"""verl 0.9.1's Megatron engine on megatron_dcp's upstream API (gloo, CPU).

**Its training and log-prob calls**: ``MegatronEngineWithLMHead.forward_backward_batch`` itself
(verl's scheduler, THD preprocessing, forward step, logits processor, per-token loss regime,
``postprocess_dynamic_cp_batch``) with verl's ``sft_loss``, on a tiny megatron GPT at 4 and 8
ranks: log-probs (``forward_only``), loss and gradients equal a single-process run. Stubs, each
because it cannot run here: a CPU platform registered in verl's ``PlatformRegistry`` (selected
with ``VERL_PLATFORM``; verl's device helpers assume CUDA otherwise); the engine object made
with ``__new__`` and given its configs (a real ``McoreEngineConfig``; a model config holding a
transformers ``LlamaConfig`` without weights, a pad token id and MTP off), because
``MegatronEngine.__init__`` builds its model through a bridge from HF weights.

**Its start-up**: the engine's own ``_init_device_mesh`` (it checks that ``initialize_model_parallel`` has the
``dynamic_context_parallel`` keyword, then passes it), a reference-model engine in the same
process (it checks the dynamic groups exist), and the engine's data-parallel group under DCP (the
one-rank group: a replicated batch is one data-parallel replica, so verl's token-count
all-reduce over it is the identity), called on a stand-in ``self`` that holds only the config
they read."""

from types import SimpleNamespace

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
for extra_module in ("verl", "tensordict"):
    pytest.importorskip(
        extra_module, reason="needs the `verl` extra (scripts/setup_env.sh installs it)"
    )

import contextlib  # noqa: E402
import os  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_verl_dcp import (  # noqa: E402
    OPTIONS,
    init_verl_megatron,
    observe_verl_plans,
    verl_batch,
)
from verl.plugin.platform import platform_manager  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.workers.config.engine import McoreEngineConfig  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import (  # noqa: E402
    MegatronEngine,
    MegatronEngineWithLMHead,
)
from verl.workers.utils.losses import sft_loss  # noqa: E402

import megatron_dcp  # noqa: E402
from megatron_dcp.integration.patches import enable_cpu_backend  # noqa: E402
from megatron_dcp.testing.gpt import (  # noqa: E402
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
    make_samples,
    unpacked_token_losses,
)
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

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
    assert done.stdout.strip().endswith("megatron_dcp.integration.megatron_dev_api")


# ------------------------------------------------------------------------------------------------
# forward_backward_batch
# ------------------------------------------------------------------------------------------------

CPU_PLATFORM = "megatron-dcp-cpu"


class CPUPlatform(PlatformBase):
    """Stub: verl's device helpers on CPU (gloo), registered as ``VERL_PLATFORM=megatron-dcp-cpu``."""

    device_name, vendor_name, device_module = "cpu", "none", torch.cpu

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"  # verl moves batches with .to(get_device_id())

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def use_cpu_platform() -> None:
    """Select the stub platform in this (forked) worker; verl caches the platform it detected."""
    platform_manager.PlatformRegistry.register(platform=CPU_PLATFORM)(CPUPlatform)
    os.environ["VERL_PLATFORM"] = CPU_PLATFORM
    platform_manager._current_platform = None


def lm_engine(model, cp: int, budget: int) -> MegatronEngineWithLMHead:
    """A verl LM engine around ``model`` (the stubbed construction: module docstring)."""
    from transformers import LlamaConfig

    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(
        dynamic_context_parallel=True,
        max_seqlen_per_dp_cp_rank=budget,
        context_parallel_size=cp,
        use_remove_padding=True,
    )
    engine.model_config = SimpleNamespace(
        model_type="language_model",
        hf_config=LlamaConfig(architectures=["LlamaForCausalLM"]),
        tokenizer=SimpleNamespace(pad_token_id=0),
        mtp=SimpleNamespace(enable=False, enable_train=False),
    )
    engine.module, engine.tf_config = [model], model.config
    engine.enable_routing_replay, engine.mini_layer_topk_idx_list = False, []
    return engine


def engine_step(rank: int, world_size: int, samples, cp: int, budget: int) -> dict:
    """verl's compute-log-prob call, then its training call with ``sft_loss``; and what verl's
    plan of the training call gave this rank."""
    use_cpu_platform()
    plans = observe_verl_plans()
    init_verl_megatron(cp)
    (model,) = build_tiny_gpt(cp=cp, options=OPTIONS)
    engine = lm_engine(model, cp, budget)
    batch = verl_batch(samples)
    batch["temperature"] = torch.ones(len(samples))
    with torch.no_grad():
        log_probs = engine.forward_backward_batch(batch.clone(), None, forward_only=True)
    trained = engine.forward_backward_batch(batch, partial(sft_loss, None), forward_only=False)
    # megatron's finalize_model_grads divides by the summed local token counts: every token.
    tokens = sum(len(sample["tokens"]) for sample in samples)
    output = log_probs["model_output"].get("log_probs")
    return {
        "log_probs": None if output is None else list(output.unbind()),
        "loss": sum(trained["loss"]),
        "grads": {name: g / tokens for name, g in gather_full_tensors([model]).items()},
        "ran": plans[-1],
    }


def sft_reference(rank: int, world_size: int, samples) -> dict:
    """One process, no CP: verl's SFT loss (log-prob of token t+1 weighted by mask[t+1] over the
    loss-token count) and its gradients; per-position log-probs."""
    init_megatron(seed=OPTIONS.seed)
    (model,) = build_tiny_gpt(options=OPTIONS)
    count = sum(float(sample["loss_mask"].sum()) for sample in samples)
    log_probs, total = [], 0.0
    for sample in samples:
        nll = unpacked_token_losses(model, sample).view(-1)
        weights = torch.cat([sample["loss_mask"][1:], torch.zeros(1)])
        loss = (nll * weights).sum() / count
        loss.backward()
        total += loss.item()
        log_probs.append(-nll.detach())
    return {"log_probs": log_probs, "loss": total, "grads": gather_full_tensors([model])}


@pytest.mark.parametrize(
    "lengths, world, cp, budget",
    [([40, 7, 90, 30, 12, 55, 3, 20], 4, 2, 48), ([120, 9, 33, 64, 5, 80, 17, 41, 26], 8, 4, 32)],
    ids=["world4", "world8"],
)
def test_engine_forward_backward_batch_equals_single_process(lengths, world, cp, budget):
    samples = make_samples(lengths, OPTIONS.vocab_size, seed=world)
    for sample in samples:  # verl's SFT loss rolls the flat mask: no sample's first token counts
        sample["loss_mask"][0] = 0
    results = run_distributed(engine_step, world, samples, cp, budget, timeout_s=TIMEOUT_S)
    (reference,) = run_distributed(sft_reference, 1, samples, timeout_s=TIMEOUT_S)
    assert_covers([r["ran"] for r in results], Layout(dp=world // cp, cp=cp))  # a mix
    assert results[0]["log_probs"] is not None  # the output rank: DP 0, CP 0
    for got, want in zip(results[0]["log_probs"], reference["log_probs"]):
        # verl's label of a sequence's last position wraps to its first token: not compared.
        torch.testing.assert_close(got[:-1], want[:-1], rtol=1e-5, atol=1e-5)
    for result in results:
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
