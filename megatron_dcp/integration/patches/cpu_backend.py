"""The CPU entries of the patch table: megatron-core (``cpu_backend``) and megatron.training
(``cpu_training``) on a machine without CUDA. Every entry applies only when CUDA is absent; the
stand-ins themselves live in ``integration/cpu/``."""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, Tuple

import torch

from megatron_dcp.integration.cpu import backend, gdn_kernels, mamba_kernels
from megatron_dcp.integration.cpu.core_attention import ReferenceCoreAttention
from megatron_dcp.integration.cpu.hybrid_stack import THD_INDICES, local_norm
from megatron_dcp.integration.cpu.vision_norms import with_local_vit_norms
from megatron_dcp.integration.cpu.parallel import (
    clip_grad_by_total_norm_cpu,
    cuda_type_names,
    sequence_parallel_norm,
)
from megatron_dcp.integration.cpu.token_dispatcher import split_sizes_as_numpy
from megatron_dcp.integration.patches.table import (
    NO_CUDA,
    Entry,
    ModePatch,
    Patch,
    is_applied,
    swapped_attribute,
)


def _stand_in(value: Any) -> Callable[[Any, Any], Any]:
    return lambda owner, original: value


def _cuda_entry(attr: str, value: Any, corrects: str) -> Patch:
    target = (f"torch.cuda:{attr}",)
    return Patch(f"cuda_{attr}", "cpu_backend", target, corrects, _stand_in(value), NO_CUDA)


_CUDA = backend.torch_cuda_stand_ins()
_DEVICE = "megatron calls torch.cuda.current_device() as a device argument in ~90 places."
_STREAMS = (
    "DDP's bucket bookkeeping and the pipeline schedules order work on CUDA streams and events; "
    "on CPU work is already ordered, so they are no-op stand-ins."
)
_RNG = (
    "model_parallel_cuda_manual_seed and the RNG tracker save, seed and restore the CUDA "
    "generator; on CPU that is the default CPU generator."
)
_STREAM_ATTRS = ("synchronize", "Stream", "Event", "current_stream", "default_stream", "stream")
_RNG_ATTRS = ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all")

_MIXER = "megatron.core.ssm.mamba_mixer"
_KERNELS = (
    "MambaMixer trains with the CUDA kernels of mamba_ssm and causal_conv1d (imported as None "
    "without them, and refused at construction): the pure-torch reference kernels instead."
)


MAMBA_KERNEL_PATCHES: Tuple[Patch, ...] = (
    *(
        Patch(f"mamba_{name}", "cpu_backend", (f"{_MIXER}:{name}",), _KERNELS, replace, NO_CUDA)
        for name, replace in (
            ("HAVE_MAMBA_SSM", _stand_in(True)),
            ("causal_conv1d_fn", _stand_in(mamba_kernels.causal_conv1d_fn)),
            ("mamba_chunk_scan_combined", _stand_in(mamba_kernels.mamba_chunk_scan_combined)),
            (
                "mamba_split_conv1d_scan_combined",
                _stand_in(mamba_kernels.mamba_split_conv1d_scan_combined),
            ),
            ("RMSNormGated", _stand_in(mamba_kernels.RMSNormGated)),
            ("ExtendedRMSNorm", _stand_in(mamba_kernels.ShardedRMSNormGated)),
        )
    ),
    Patch(
        "mamba_kernel_versions",
        "cpu_backend",
        (f"{_MIXER}:is_mamba_min_version", f"{_MIXER}:is_causal_conv1d_min_version"),
        "MambaMixer checks the mamba_ssm / causal_conv1d versions before it packs sequences; "
        "the reference kernels support packing (seq_idx).",
        _stand_in(lambda version, check_equality=True: True),
        NO_CUDA,
    ),
)

_GDN = "megatron.core.ssm.gated_delta_net"
_GDN_KERNELS = (
    "GatedDeltaNet trains with flash-linear-attention's Triton kernels (chunk_gated_delta_rule, "
    "causal_conv1d, l2norm; imported as None without fla, and refused at construction): the "
    "pure-torch reference kernels instead."
)



def _uncompiled(owner: Any, original: Callable) -> Callable:
    """The function ``torch.compile`` wrapped (megatron's ``jit_fuser``)."""
    return getattr(original, "_torchdynamo_orig_callable", original)


GDN_KERNEL_PATCHES: Tuple[Patch, ...] = (
    *(
        Patch(f"gdn_{name}", "cpu_backend", (target,), _GDN_KERNELS, replace, NO_CUDA)
        for name, target, replace in (
            ("HAVE_FLA", f"{_GDN}.common:HAVE_FLA", _stand_in(True)),
            ("l2norm", f"{_GDN}.common:l2norm", _stand_in(gdn_kernels.l2norm)),
            ("causal_conv1d", f"{_GDN}.gdn:causal_conv1d", _stand_in(gdn_kernels.causal_conv1d)),
            (
                "chunk_gated_delta_rule",
                f"{_GDN}.gdn:chunk_gated_delta_rule",
                _stand_in(gdn_kernels.chunk_gated_delta_rule),
            ),
        )
    ),
    Patch(
        "gdn_eager_helpers",
        "cpu_backend",
        tuple(
            f"{_GDN}.common:_GDNBase.{name}"
            for name in (
                "_prepare_input_for_gated_delta_rule",
                "_compute_g_and_beta",
                "_apply_gated_norm",
            )
        ),
        "GatedDeltaNet's element-wise helpers are torch.compile'd (jit_fuser): on CPU inductor "
        "compiles them again for each new packed length, seconds every time on every rank, and "
        "fuses nothing the CPU gains from; eager instead.",
        _uncompiled,
        NO_CUDA,
    ),
)

_LLAVA = "megatron.core.models.multimodal.llava_model"
_LLAVA_ATTENTION = (
    "LLaVAModel asserts Transformer Engine's attention (and TE >= 1.10) when its language model "
    "has CP or sequence parallelism; the CPU backend's language spec has the reference "
    "attention, the oracle of TE's (DCP micro-batches never reach LLaVA's TE-only sharding)."
)
LLAVA_ATTENTION_PATCHES: Tuple[Entry, ...] = (
    *(
        Patch(
            f"llava_{name}", "cpu_backend", (f"{_LLAVA}:{name}",), _LLAVA_ATTENTION, replace, NO_CUDA
        )
        for name, replace in (
            ("HAVE_TE", _stand_in(True)),
            ("TEDotProductAttention", _stand_in(ReferenceCoreAttention)),
            ("is_te_min_version", _stand_in(lambda version, check_equality=True: True)),
        )
    ),
    Patch(
        "clip_vit_local_norm",
        "cpu_backend",
        ("megatron.core.models.vision.clip_vit_model:CLIPViTModel.__init__",),
        "Without Transformer Engine, CLIPViTModel's default norms are torch.nn.LayerNorm, which "
        "its own build_module call cannot construct (it passes config=): megatron's local norm "
        "(TENorm's signature) instead, unless the caller names one.",
        lambda owner, original: with_local_vit_norms(original),
        NO_CUDA,
    ),
)


CPU_BACKEND_PATCHES: Tuple[Entry, ...] = (
    ModePatch(
        "cuda_devices_to_cpu",
        "cpu_backend",
        "Rotary embeddings, the causal mask, the pipeline schedules, p2p and DDP buffers allocate "
        "with device='cuda' / .cuda() / .to('cuda') / pin_memory: rewritten to the CPU.",
        backend.CudaToCpuMode,
        NO_CUDA,
    ),
    _cuda_entry("current_device", _CUDA["current_device"], _DEVICE),
    *(_cuda_entry(attr, _CUDA[attr], _STREAMS) for attr in _STREAM_ATTRS),
    *(_cuda_entry(attr, _CUDA[attr], _RNG) for attr in _RNG_ATTRS),
    Patch(
        "cuda_random_get_rng_state",
        "cpu_backend",
        ("torch.cuda.random:get_rng_state",),
        _RNG,
        _stand_in(backend.cpu_rng_state),
        NO_CUDA,
    ),
    *(
        Patch(
            f"megatron{attr}",
            "cpu_backend",
            (f"megatron.core.tensor_parallel.random:{attr}",),
            "megatron's RNG tracker reads and writes the CUDA generator state directly.",
            _stand_in(stand_in),
            NO_CUDA,
        )
        for attr, stand_in in backend.megatron_rng_stand_ins().items()
    ),
    Patch(
        "sequence_parallel_torch_norm",
        "cpu_backend",
        ("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",),
        "megatron's torch norm (the local norm without apex) asserts not sequence_parallel; "
        "built with the flag off, its parameters marked sequence_parallel so that "
        "finalize_model_grads sums their per-shard gradients over TP, as apex's and TE's norms do.",
        lambda owner, original: sequence_parallel_norm(original),
        NO_CUDA,
    ),
    Patch(
        "distributed_optimizer_cpu_params",
        "cpu_backend",
        ("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",),
        "DistributedOptimizer accepts only parameters whose type() is torch.cuda.*Tensor; while "
        "it is built, CPU tensors answer their CUDA type name.",
        lambda owner, original: cuda_type_names(original),
        NO_CUDA,
    ),
    Patch(
        "mixed_precision_optimizer_cpu_params",
        "cpu_backend",
        ("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",),
        "The mixed-precision optimizer (--bf16/--fp16 without the distributed optimizer) accepts "
        "only parameters whose type() is torch.cuda.*Tensor; while it is built, CPU tensors "
        "answer their CUDA type name, so bf16/fp16 parameters get their fp32 main copies.",
        lambda owner, original: cuda_type_names(original),
        NO_CUDA,
    ),
    Patch(
        "moe_split_sizes_numpy",
        "cpu_backend",
        ("megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",),
        "The alltoall MoE dispatcher gets its all-to-all split sizes as numpy from a helper that "
        "converts only CUDA tensors; CPU tensors as split sizes make all_to_all_single raise a "
        "TypeError with expert parallelism > 1.",
        lambda owner, original: split_sizes_as_numpy(original),
        NO_CUDA,
    ),
    Patch(
        "hybrid_final_norm",
        "cpu_backend",
        ("megatron.core.models.hybrid.hybrid_block:TENorm",),
        "HybridStack builds its final norm with TENorm whatever the layer spec, which needs "
        "Transformer Engine: megatron's local norm of the same type instead.",
        _stand_in(local_norm),
        NO_CUDA,
    ),
    Patch(
        "mamba_cp_thd_indices",
        "cpu_backend",
        ("megatron.core.ssm.mamba_context_parallel:tex",),
        "Mamba's CP all-to-alls reorder packed (THD) sequences with Transformer Engine's "
        "thd_get_partitioned_indices: the same indices from the runtime's zigzag layout.",
        _stand_in(THD_INDICES),
        NO_CUDA,
    ),
    Patch(
        "mamba_cp_te_version",
        "cpu_backend",
        ("megatron.core.ssm.mamba_context_parallel:is_te_min_version",),
        "Mamba's CP all-to-alls assert Transformer Engine ≥ 1.10 before they reorder THD "
        "sequences; with the stand-in indices the check holds.",
        _stand_in(lambda version, check_equality=True: True),
        NO_CUDA,
    ),
    *MAMBA_KERNEL_PATCHES,
    *GDN_KERNEL_PATCHES,
    *LLAVA_ATTENTION_PATCHES,
)


# ------------------------------------------------------------------------------------------------
# megatron.training
# ------------------------------------------------------------------------------------------------


def _initialize_on_cpu(owner: Any, original: Callable) -> Callable:
    """``initialize_megatron`` with its own ``allow_no_cuda=True``, seeing one device while it
    runs (otherwise it silently skips the model-parallel groups and the seeds)."""

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        with swapped_attribute(torch.cuda, "device_count", lambda: 1):
            with swapped_attribute(torch.cuda, "set_device", lambda *a, **k: None):
                return original(*args, **kwargs)

    return initialize_megatron


def _skip_compile_helpers(owner: Any, original: Callable) -> Callable:
    importlib.import_module("megatron.core.datasets.helpers_cpp")  # fails loudly if missing
    return lambda: None


def _reference_attention_in_mtp(owner: Any, original: Callable) -> Callable:
    from megatron_dcp.integration.cpu.core_attention import with_core_attention

    @functools.wraps(original)
    def mtp_block_spec(*args: Any, **kwargs: Any) -> Any:
        spec = original(*args, **kwargs)
        return None if spec is None else with_core_attention(spec)

    return mtp_block_spec


def _forked_results_queue(owner: Any, original: Callable) -> Callable:
    """``original`` with its manager started by fork instead of spawn: the server process is a
    copy of the rank, so it neither re-runs the training entry module (spawn re-imports
    ``__main__``) nor imports torch to unpickle the write results it is sent."""

    @functools.wraps(original)
    def forked_manager(mp_mode: str = "spawn") -> Any:
        return original(mp_mode="fork")

    return forked_manager


def _training(name: str, targets: Tuple[str, ...], corrects: str, replace: Callable) -> Patch:
    return Patch(name, "cpu_training", targets, corrects, replace, NO_CUDA)


_NOOP = _stand_in(lambda *args, **kwargs: None)

CPU_TRAINING_PATCHES: Tuple[Patch, ...] = (
    _training(
        "initialize_megatron_without_cuda",
        (
            "megatron.training.initialize:initialize_megatron",
            "megatron.training.training:initialize_megatron",
        ),
        "initialize_megatron asserts CUDA, and without a device skips the model-parallel groups "
        "and seeds.",
        _initialize_on_cpu,
    ),
    _training(
        "skip_compile_helpers",
        ("megatron.core.datasets.utils:compile_helpers",),
        "The wheel ships the dataset helper extension prebuilt but no Makefile; compile_helpers "
        "runs make, which fails and exits.",
        _skip_compile_helpers,
    ),
    _training(
        "device_arch_version",
        (
            "megatron.core.utils:get_device_arch_version",
            "megatron.training.arguments:get_device_arch_version",
        ),
        "Argument validation asks the CUDA device architecture when tp or cp > 1.",
        _stand_in(lambda: 0),
    ),
    _training(
        "cpu_grad_clipping",
        (
            "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
            "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
        ),
        "Gradient clipping asserts torch.cuda.FloatTensor gradients.",
        _stand_in(clip_grad_by_total_norm_cpu),
    ),
    _training(
        "skip_jit_fusion_warmup",
        (
            "megatron.training.initialize:set_jit_fusion_options",
            "megatron.training.training:set_jit_fusion_options",
        ),
        "The JIT fusion warm-up costs seconds per rank and fuses nothing on CPU.",
        _NOOP,
    ),
    _training(
        "eager_mode",
        ("torch._dynamo.config:disable",),
        "megatron's jit_fuser (torch.compile) builds C++ kernels with inductor in every rank at "
        "the first step (tens of seconds on two cores for a tiny model): eager mode instead.",
        _stand_in(True),
    ),
    _training(
        "checkpoint_queue_forked",
        ("megatron.core.dist_checkpointing.strategies.filesystem_async:get_write_results_queue",),
        "The first checkpoint save starts a multiprocessing manager (spawn) for its write "
        "results, whose fresh server process re-imports the entry module and imports torch to "
        "unpickle the results: seconds of CPU per rank, every rank at once. Forked, it needs "
        "neither.",
        _forked_results_queue,
    ),
    _training(
        "reference_attention_in_mtp",
        ("megatron.training.models.gpt:mtp_block_spec",),
        "mtp_block_spec builds the MTP layers from megatron's default decoder spec, ignoring the "
        "layer spec the entry point passes: their core attention must be the reference one too.",
        _reference_attention_in_mtp,
    ),
)


def cpu_backend_enabled() -> bool:
    """True while the ``cpu_backend`` group of the patch table is applied (no CUDA)."""
    return is_applied(CPU_BACKEND_PATCHES[0])
