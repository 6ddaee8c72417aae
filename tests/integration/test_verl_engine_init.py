"""verl 0.9.1's Megatron engine as verl builds it, on CPU (gloo, 4 ranks).

A tiny Llama (random weights, a word-level tokenizer) is written locally with ``transformers``;
nothing is downloaded. verl's ``HFModelConfig`` reads it from that folder, and
``MegatronEngineWithLMHead`` is constructed as verl's worker constructs it (``EngineRegistry.new``),
by its own ``__init__``, from real verl configs
(``McoreEngineConfig``, ``McoreOptimizerConfig``, ``CheckpointConfig``), which initialises
megatron's model parallelism (with the dynamic DP×CP groups when dynamic CP is on). Then
``engine.initialize()`` runs verl's own code: the transformer config from the bridge, the model
from the bridge (``make_megatron_module``), the weights from the checkpoint, verl's optimizer, LR
scheduler and checkpoint manager. Then one log-prob call (``infer_batch``) and one training step
(``train_batch`` with verl's ``sft_loss``) with dynamic CP on (CP 2 within DP×CP 4) and off (DP
4): log-probs, loss, gradients and grad norm equal.

**The bridge.** verl 0.9.1's engine asserts ``use_mbridge`` and takes one of two bridges; neither
runs here (docs/rl.md, "verl's engine as verl builds it", has the lines):

- ``vanilla_mbridge=False`` (verl's default): Megatron-Bridge (``megatron.bridge``). Its releases
  0.4.0 to 0.6.2 require Python 3.12 (0.3.1: transformers < 5); installed anyway, it imports
  Transformer Engine unconditionally (``megatron/bridge/peft/lora_layers.py:20``), which needs
  CUDA, and verl asks it for the flash attention backend.
- ``vanilla_mbridge=True`` (deprecated): mbridge 0.15.1, its last release, builds the model with
  ``ModelType.encoder_and_decoder`` (``mbridge/core/util.py:83``), which megatron-core 0.19.2 no
  longer has, and with Transformer Engine's layer spec (``mbridge/core/llm_bridge.py:150``).

So the bridge is the one stub here: ``LocalLlamaBridge`` stands in for mbridge's ``AutoBridge``
under the name verl imports it by (``verl.models.mcore.mbridge``), with the calls verl's engine
makes on it (``from_config``, ``set_extra_args``, ``config``, ``get_model``, ``load_weights``):
the Llama config converted to a megatron ``TransformerConfig``, a ``GPTModel`` with megatron's
local layer spec and megatron_dcp's CPU core attention, wrapped in ``Float16Module`` and
megatron's DDP as mbridge wraps it, the Hugging Face weights converted from the safetensors file
(checked against transformers' own forward of the checkpoint). The other stub is
test_verl_engine.py's CPU platform (verl's device helpers assume CUDA). The gradients are read,
not changed, just before verl's ``optimizer_step``; verl's scheduler's plan likewise.

Dropout is off (the Llama config's ``attention_dropout`` is 0 and the converted config sets
``hidden_dropout = attention_dropout = 0``): the two layouts draw different random masks otherwise.
verl's engine refuses any dtype but bf16 and fp16, so the model runs in bf16 (fp32 main
gradients): the two layouts round differently, hence the tolerances below.
"""

from __future__ import annotations

import os
import sys
import types
from functools import partial

import pytest

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")
for extra_module in ("verl", "tensordict", "transformers", "tokenizers", "safetensors"):
    pytest.importorskip(
        extra_module, reason="needs the `verl` extra (scripts/setup_env.sh installs it)"
    )

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_verl_engine import use_cpu_platform  # noqa: E402

import megatron_dcp  # noqa: E402
from megatron_dcp.integration.patches import enable_cpu_training  # noqa: E402
from megatron_dcp.testing.plan_coverage import (  # noqa: E402
    Layout,
    RanPlan,
    assert_covers,
    parallel_layout,
)

TIMEOUT_S = 240
WORLD = 4
VOCAB = 96
PAD_ID = VOCAB - 1
LENGTHS = (40, 7, 90, 30, 12, 55, 3, 20)  # DCP off: two samples per DP rank, in this order
# bf16 (module docstring): log-prob difference, relative loss and grad-norm difference, largest
# gradient difference relative to the largest gradient of the same parameter.
LOG_PROB_ATOL, LOSS_RTOL, GRAD_TOL = 0.05, 2e-3, 2e-2
BUDGET = 48  # max_seqlen_per_dp_cp_rank under DCP: the 90- and 55-token samples need CP 2 or more


# ------------------------------------------------------------------------------------------------
# The Hugging Face checkpoint
# ------------------------------------------------------------------------------------------------


def write_tiny_llama(folder: str) -> None:
    """A 2-layer Llama (GQA, untied head) with random weights and a word-level tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<pad>": PAD_ID}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="<pad>",
        unk_token="<pad>",
    )
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked predictions: a misplaced weight shows in the log-probs
        pad_token_id=PAD_ID,
        eos_token_id=PAD_ID,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny_llama"))
    write_tiny_llama(folder)
    return folder


def make_samples(seed: int = 7) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for length in LENGTHS:
        tokens = torch.randint(0, VOCAB - 1, (length,), generator=generator)
        loss_mask = torch.ones(length, dtype=torch.long)
        loss_mask[: max(1, length // 4)] = 0  # a prompt; verl's SFT loss rolls the flat mask
        samples.append({"input_ids": tokens, "loss_mask": loss_mask})
    return samples


# ------------------------------------------------------------------------------------------------
# The stand-in bridge (module docstring: why)
# ------------------------------------------------------------------------------------------------


def llama_transformer_config(hf_config, dtype: torch.dtype, extra: dict):
    """megatron's TransformerConfig of a Llama, no dropout, no fused kernels (CPU)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_config.hidden_size // hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=hf_config.attention_dropout,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
    )
    return TransformerConfig(**{**fields, **extra})


def llama_to_megatron(hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Hugging Face Llama tensors by megatron GPTModel name (local spec, TP 1): q, k and v
    interleaved per query group into ``linear_qkv``, gate and up stacked into ``linear_fc1``."""
    groups, dim = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // groups
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for layer in range(config.num_layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        q = hf[src + "self_attn.q_proj.weight"].view(groups, per_group * dim, -1)
        k = hf[src + "self_attn.k_proj.weight"].view(groups, dim, -1)
        v = hf[src + "self_attn.v_proj.weight"].view(groups, dim, -1)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).flatten(0, 1)
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    return out


class LocalLlamaBridge:
    """Stand-in for mbridge's ``AutoBridge``: the calls verl's engine makes on it, for a Llama on
    one pipeline stage, TP 1, megatron's local layer spec with megatron_dcp's CPU core attention."""

    def __init__(self, hf_config, dtype: torch.dtype):
        self.hf_config, self.dtype, self.extra, self._config = hf_config, dtype, {}, None

    @classmethod
    def from_config(cls, hf_config, dtype: torch.dtype) -> "LocalLlamaBridge":
        assert hf_config.model_type == "llama", hf_config.model_type
        return cls(hf_config, dtype)

    def set_extra_args(self, **kwargs) -> None:
        self.extra.update(kwargs)
        self._config = None

    @property
    def config(self):
        if self._config is None:
            self._config = llama_transformer_config(self.hf_config, self.dtype, self.extra)
        return self._config

    def get_model(
        self,
        post_model_creation_callbacks=(),
        wrap_with_ddp=True,
        fp16=False,
        bf16=True,
        ddp_config=None,
        **unused,
    ) -> list:
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.module import Float16Module

        from megatron_dcp.integration.cpu.core_attention import reference_layer_spec

        assert not post_model_creation_callbacks, "value models and frozen routers: not covered"
        config = self.config
        model = GPTModel(
            config=config,
            transformer_layer_spec=reference_layer_spec(),
            vocab_size=self.hf_config.vocab_size,
            max_sequence_length=self.hf_config.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=self.hf_config.rope_theta,
            share_embeddings_and_output_weights=self.hf_config.tie_word_embeddings,
        )
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if fp16 or bf16:
            model = Float16Module(config, model)
        if wrap_with_ddp:
            ddp = DistributedDataParallelConfig(**(ddp_config or {}))
            model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
        return [model]

    def load_weights(self, models: list, path: str) -> None:
        from safetensors.torch import load_file

        (model,) = models
        while hasattr(model, "module"):
            model = model.module
        weights = llama_to_megatron(load_file(f"{path}/model.safetensors"), self.config)
        params = dict(model.named_parameters())
        assert sorted(params) == sorted(weights), set(params) ^ set(weights)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])


def install_stand_in_bridge() -> None:
    """verl's engine imports ``AutoBridge`` from ``verl.models.mcore.mbridge`` when
    ``vanilla_mbridge=True`` (``make_megatron_module`` also its two model callbacks)."""
    module = types.ModuleType("verl.models.mcore.mbridge")
    module.AutoBridge = LocalLlamaBridge
    module.make_value_model = module.freeze_moe_router = None
    sys.modules["verl.models.mcore.mbridge"] = module


# ------------------------------------------------------------------------------------------------
# The engine, built and run as verl does
# ------------------------------------------------------------------------------------------------


def build_engine(model_dir: str, dynamic: bool, stand_in: bool):
    """verl's configs, its engine's ``__init__`` (megatron initialised there) and ``initialize``."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    model_config = HFModelConfig(path=model_dir)
    engine_config = McoreEngineConfig(
        dynamic_context_parallel=dynamic,
        max_seqlen_per_dp_cp_rank=BUDGET if dynamic else None,
        context_parallel_size=2 if dynamic else 1,
        use_remove_padding=True,
        use_mbridge=True,
        vanilla_mbridge=stand_in,
        dtype="bfloat16",
        seed=11,
    )
    # Adam under megatron's distributed optimizer (verl's defaults); the LR schedule needs a length.
    optimizer_config = McoreOptimizerConfig(lr=1e-3, total_training_steps=1)
    # As verl's worker does (verl/workers/engine_workers.py): the registry picks the class by
    # device; the Megatron engine is registered for cuda, VERL_ENGINE_DEVICE is verl's override.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    assert type(engine) is MegatronEngineWithLMHead
    engine.initialize()
    return engine


def engine_batch(samples: list[dict], dynamic: bool):
    """verl's batch: jagged rows; without DCP, this DP rank's contiguous shard."""
    from megatron.core import parallel_state as mpu
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    if not dynamic:
        per_rank = len(samples) // mpu.get_data_parallel_world_size()
        start = mpu.get_data_parallel_rank() * per_rank
        samples = samples[start : start + per_rank]

    def nested(name):
        return torch.nested.as_nested_tensor([s[name] for s in samples], layout=torch.jagged)

    batch = TensorDict(
        {"input_ids": nested("input_ids"), "loss_mask": nested("loss_mask")},
        batch_size=[len(samples)],
    )
    batch["temperature"] = torch.ones(len(samples))
    tu.assign_non_tensor(batch, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    return batch


def reduced_gradients(engine) -> dict[str, torch.Tensor]:
    """The gradients verl's optimizer steps with, by parameter name (a copy). Its distributed
    optimizer reduce-scatters each gradient bucket over DP×CP: a rank holds its own shard reduced
    (the rest of the bucket is its local part), so the reduced shards are gathered."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from megatron_dcp.testing.gpt import unwrap

    (chunk,) = engine.module
    names = {param: name for name, param in unwrap(chunk).named_parameters()}
    grads = {}
    for buffer in chunk.buffers:
        group = buffer.data_parallel_group
        full = torch.empty_like(buffer.grad_data)
        for bucket in buffer.buckets:
            shards = shard_buffer(bucket.grad_data, dist.get_world_size(group))
            gathered = [torch.empty_like(shard) for shard in shards]
            dist.all_gather(gathered, shards[dist.get_rank(group)].clone(), group=group)
            full[bucket.offset : bucket.offset + bucket.grad_data.numel()] = torch.cat(gathered)
        for param, (start, end, _) in buffer.param_index_map.items():
            grads[names[param]] = full[start:end].view(param.shape).clone()
    return grads


def engine_step(rank: int, world_size: int, model_dir: str, samples, dynamic: bool, stand_in: bool):
    """One log-prob call and one training step of verl's engine; log-probs by sample index."""
    from megatron.core import parallel_state as mpu
    from verl.utils import tensordict_utils as tu
    from verl.utils.dynamic_cp_scheduler import DynamicCPScheduler
    from verl.workers.utils.losses import sft_loss

    use_cpu_platform()
    enable_cpu_training()  # the CPU backend, and gradient clipping on CPU tensors
    megatron_dcp.install_upstream_api()
    if stand_in:
        install_stand_in_bridge()
    engine = build_engine(model_dir, dynamic, stand_in)
    batch = engine_batch(samples, dynamic)
    first = 0 if dynamic else mpu.get_data_parallel_rank() * len(batch)

    with engine.eval_mode():
        inferred = engine.infer_batch(batch.clone())
    grads = {}
    step = engine.optimizer_step

    def observed_step():  # the gradients the optimizer steps with (collective on every rank)
        grads.update(reduced_gradients(engine))
        return step()

    engine.optimizer_step = observed_step
    local_cp_sizes = []
    schedule = DynamicCPScheduler.schedule

    def observed_schedule(self, *args, **kwargs):  # verl's DCP plan: each micro-batch's CP size
        micro_batches = schedule(self, *args, **kwargs)
        local_cp_sizes.extend(
            tu.get_non_tensor_data(mb, "local_cp_size", 1) for mb in micro_batches
        )
        return micro_batches

    DynamicCPScheduler.schedule = observed_schedule
    with engine.train_mode():
        trained = engine.train_batch(batch, partial(sft_loss, None))
    log_probs = inferred["model_output"].get("log_probs") if inferred else None
    return {
        "outputs": engine.is_mp_src_rank_with_outputs(),
        "log_probs": {} if log_probs is None else dict(enumerate(log_probs.unbind(), first)),
        "loss": sum(float(loss) for loss in trained.get("loss", [])),
        "grad_norm": float(trained.get("metrics", {}).get("grad_norm", float("nan"))),
        "grads": grads,
        "local_cp_sizes": local_cp_sizes,
        "cp": mpu.get_context_parallel_world_size(),
        "dp": engine.get_data_parallel_size(),
        # what ran: verl's plan under DCP; without it, every sample on the static CP size
        "ran": RanPlan(
            tuple(local_cp_sizes) or (mpu.get_context_parallel_world_size(),),
            len(local_cp_sizes),
            parallel_layout(),
        ),
    }


def hf_log_probs(model_dir: str, samples) -> list[torch.Tensor]:
    """transformers' own forward of the checkpoint (fp32): log-prob of token t+1 at position t."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    result = []
    with torch.no_grad():
        for sample in samples:
            tokens = sample["input_ids"]
            logits = model(tokens[None]).logits[0].float()
            picked = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]
            result.append(picked)
    return result


def run_engine(model_dir: str, samples, dynamic: bool, stand_in: bool = True) -> dict:
    results = run_distributed(
        engine_step, WORLD, model_dir, samples, dynamic, stand_in, timeout_s=TIMEOUT_S
    )
    log_probs: dict = {}
    for result in results:
        if result["outputs"]:
            assert not log_probs.keys() & result["log_probs"].keys()  # no sample twice
            log_probs.update(result["log_probs"])
    assert sorted(log_probs) == list(range(len(samples)))  # every sample once
    return {"log_probs": [log_probs[i] for i in sorted(log_probs)], "ranks": results}


def differences(on: dict, off: dict) -> dict:
    """Largest differences between the two runs (verl's last label of a sequence wraps to its
    first token: not compared). Losses: without DCP a DP rank reports its shard's loss × DP size
    (``sft_loss``'s ``dp_size`` factor), and verl averages them over DP."""
    (loss_on,) = [r["loss"] for r in on["ranks"] if r["outputs"]]
    loss_off = sum(r["loss"] for r in off["ranks"]) / WORLD
    grads_on, grads_off = on["ranks"][0]["grads"], off["ranks"][0]["grads"]
    assert grads_on.keys() == grads_off.keys()
    return {
        "log_prob": max(
            (a[:-1].float() - b[:-1].float()).abs().max().item()
            for a, b in zip(on["log_probs"], off["log_probs"])
        ),
        "loss": abs(loss_on / loss_off - 1),
        "grad_norm": abs(on["ranks"][0]["grad_norm"] / off["ranks"][0]["grad_norm"] - 1),
        "grad": max(
            ((grads_on[n] - g).abs().max() / g.abs().max()).item() for n, g in grads_off.items()
        ),
    }


def assert_checkpoint_weights(engine_log_probs, hf_log_probs) -> None:
    """The engine's weights are the checkpoint's: its log-probs (bf16) are transformers' own
    (fp32) up to bf16 rounding, on average 0.03 here, where a misplaced weight moves them by
    about their spread (1.6)."""
    gaps = torch.cat([(a[:-1].float() - b).abs() for a, b in zip(engine_log_probs, hf_log_probs)])
    assert gaps.mean().item() <= 0.1 and gaps.max().item() <= 0.5, (gaps.mean(), gaps.max())


def assert_equal_runs(on: dict, off: dict) -> None:
    found = differences(on, off)
    assert found["log_prob"] <= LOG_PROB_ATOL, found
    assert found["loss"] <= LOSS_RTOL and found["grad_norm"] <= LOSS_RTOL, found
    assert found["grad"] <= GRAD_TOL, found


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------


def test_engine_built_by_verl_dcp_on_equals_off(llama_dir):
    samples = make_samples()
    on = run_engine(llama_dir, samples, dynamic=True)
    off = run_engine(llama_dir, samples, dynamic=False)
    assert {(r["cp"], r["dp"]) for r in on["ranks"]} == {(2, 1)}  # DCP: replicated batch
    assert {(r["cp"], r["dp"]) for r in off["ranks"]} == {(1, WORLD)}
    assert_covers([r["ran"] for r in on["ranks"]], Layout(dp=2, cp=2), mix_of={1, 2})
    assert_covers([r["ran"] for r in off["ranks"]], Layout(dp=WORLD), cp_sizes={1})
    assert_equal_runs(on, off)
    assert max(on["ranks"][0]["local_cp_sizes"]) == 2  # the long samples ran with CP 2
    assert_checkpoint_weights(off["log_probs"], hf_log_probs(llama_dir, samples))


def default_bridge_stop(rank: int, world_size: int, model_dir: str) -> dict:
    """verl's default bridge, no stand-in: how far the engine gets."""
    from megatron.core import parallel_state as mpu

    use_cpu_platform()
    enable_cpu_training()
    megatron_dcp.install_upstream_api()
    with pytest.raises(ImportError) as stop:
        build_engine(model_dir, dynamic=True, stand_in=False)
    return {"initialized": mpu.is_initialized(), "stop": repr(stop.value)}


def test_verls_default_bridge_is_what_stops_the_engine_here(llama_dir):
    """The engine's ``__init__`` runs (megatron initialised); ``initialize`` stops at verl's
    import of Megatron-Bridge, the blocker named in docs/rl.md."""
    import importlib.util

    if importlib.util.find_spec("megatron.bridge") is not None:
        pytest.skip("Megatron-Bridge is installed: the blocker is gone")
    results = run_distributed(default_bridge_stop, 2, llama_dir, timeout_s=TIMEOUT_S)
    for result in results:
        assert result["initialized"]
        assert "megatron.bridge" in result["stop"], result["stop"]
