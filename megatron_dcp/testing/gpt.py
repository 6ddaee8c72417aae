"""Fixtures for integration tests: a tiny megatron GPT on CPU, identical weights in every layout,
and the single-process oracle every distributed layout is compared with.

Every parameter is initialised from its *global* name (``decoder.layers.<global index>...``) and a
seed, as the full tensor, then cut to this rank's TP shard; so a tp·pp·vpp·cp layout starts from
exactly the weights of the single-process model. (No gated linear unit: its TP shard is not a
contiguous slice of the full weight.)
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_dcp.integration.cpu.core_attention import reference_layer_spec, with_core_attention
from megatron_dcp.integration.cpu.gpt_layer_spec import local_transformer_spec
from megatron_dcp.integration.forward_backward import packed_seq_params_of
from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.integration.model_parallel import init_megatron
from megatron_dcp.runtime.packing import pack_samples, padding_multiple
from megatron_dcp.testing.gdn import gdn_fields, gdn_layer_spec, mark_gdn_tp_blocks
from megatron_dcp.testing.hybrid import build_hybrid_chunk, mamba_fields
from megatron_dcp.testing.mla import config_class, mla_fields
from megatron_dcp.testing.moe import (
    global_expert_name,
    gradient_sum_group,
    merge_expert_parallel,
    moe_fields,
    tensor_parallel_group,
)
from megatron_dcp.testing.precision import (
    HALF_DTYPES,
    ExactRun,
    exact_run,
    loss_scale_of,
    to_dtype,
    to_float64,
)
from megatron_dcp.tools.check.global_names import parameter_gradient, renumbered, unwrap
from megatron_dcp.tools.check.rounding import add_gradients
from megatron_dcp.tools.launching.local_ranks import run_distributed

import_megatron_core()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

Sample = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TinyGPTOptions:
    """Model shape shared by the distributed layouts and the single-process reference."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    ffn_hidden_size: int = 128
    vocab_size: int = 128
    max_sequence_length: int = 512
    mtp_layers: int = 0
    hybrid_layer_pattern: Optional[str] = None  # e.g. "M*M-": megatron's HybridModel (hybrid.py)
    # Gated DeltaNet hybrid (gdn.py): GDN layers, standard attention every N-th (None: no GDN).
    linear_attention_freq: Optional[int] = None
    seed: int = 1234
    sequence_parallel: bool = False  # applies when tp > 1 (the reference runs without it)
    # Activation recomputation (TransformerConfig's fields of the same names; None: off).
    recompute_granularity: Optional[str] = None  # "full" or "selective"
    recompute_method: Optional[str] = None  # "uniform" or "block" (full only)
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[tuple[str, ...]] = None  # selective; None: ["core_attn"]
    add_bias_linear: bool = True  # False: no linear biases (megatron's "mlp" recompute needs it)
    # Mixture of experts (None: dense). Local experts (SequentialMLP), alltoall dispatcher; the
    # expert-parallel size comes from init_megatron's ``ep`` (``expert_parallel`` for the DCP step;
    # the reference runs with 1). megatron's experts fail with linear biases: add_bias_linear=False.
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_router_load_balancing_type: Union[str, tuple[str, ...]] = "none"  # "aux_loss", ...
    moe_aux_loss_coeff: Union[float, tuple[float, ...]] = 0.0  # one per type
    moe_z_loss_coeff: Optional[float] = None
    expert_parallel: int = 1
    expert_tensor_parallel: Optional[int] = None  # None: the TP size (megatron's default)
    # Multi-latent attention (testing.mla: DeepSeek-V3's shape at toy size); q_lora_rank None:
    # queries projected directly, else through a low-rank down/up projection.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    # megatron's mixed precision, "bf16" or "fp16" (None: float32): config.bf16 or config.fp16,
    # params_dtype and pipeline_dtype the half type, as megatron.training builds it for --bf16
    # or --fp16; the DDP helpers (testing.dcp_step) then wrap each chunk in megatron's
    # Float16Module (and with fp16 the optimizer scales the loss). The mixed-precision oracle
    # (mixed_precision_reference) reads which half it emulates from it and builds without it.
    half_precision: Optional[str] = None

    def __post_init__(self) -> None:
        if self.half_precision is not None and self.half_precision not in HALF_DTYPES:
            raise ValueError(f"half_precision {self.half_precision!r}: one of {list(HALF_DTYPES)}")

    @property
    def params_dtype(self) -> torch.dtype:
        """The dtype the chunks are built in: the half type, or float32."""
        return HALF_DTYPES.get(self.half_precision, torch.float32)


@dataclasses.dataclass(frozen=True)
class ReferenceResult:
    """Summed loss, number of loss-carrying tokens and full gradients by global parameter name,
    of the float32 run; ``exact``: the same run in float64 with the float32 runs' rounding error
    (``testing.precision``), which the oracle's tolerances are derived from."""

    loss_sum: float
    num_tokens: int
    grads: dict[str, torch.Tensor] = dataclasses.field(repr=False)
    exact: Optional[ExactRun] = dataclasses.field(default=None, repr=False)


def tiny_gpt_config(
    tp: int, pp: int, cp: int, vpp: Optional[int], options: TinyGPTOptions
) -> TransformerConfig:
    """fp32 (bf16 or fp16: ``options.half_precision``), CPU-initialised, no dropout; variable
    sequence lengths per micro-batch (which needs the alltoall dispatcher setting even for dense
    models: docs/cpu_backend.md)."""
    dtype = options.params_dtype
    return config_class(options)(
        num_layers=options.num_layers,
        hidden_size=options.hidden_size,
        num_attention_heads=options.num_attention_heads,
        num_query_groups=options.num_query_groups,
        ffn_hidden_size=options.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=options.half_precision == "bf16",
        fp16=options.half_precision == "fp16",
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=options.mtp_layers or None,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True,
        sequence_parallel=options.sequence_parallel and tp > 1,
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        recompute_modules=_listed(options.recompute_modules),
        add_bias_linear=options.add_bias_linear,
        **moe_fields(options),
        **mamba_fields(options),
        **mla_fields(options),
        **gdn_fields(options),
    )


def _listed(values: Optional[Sequence[str]]) -> Optional[list[str]]:
    """A fresh list: TransformerConfig keeps (and may append to) the list it is given, and the
    options are frozen and hashable, so they hold a tuple."""
    return None if values is None else list(values)


def build_tiny_gpt(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: Optional[int] = None,
    mtp_layers: int = 0,
    options: Optional[TinyGPTOptions] = None,
    megatron_attention: bool = False,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage) of the tiny GPT, after ``init_megatron``
    with the same layout; weights are the same in every layout (module docstring).
    ``megatron_attention``: megatron's own core attention (``DotProductAttention``, sbhd only,
    no CP) instead of the CPU backend's, for an oracle that shares no code with the runtime
    (the dense and MoE GPT only)."""
    options = options or TinyGPTOptions()
    if mtp_layers:
        options = dataclasses.replace(options, mtp_layers=mtp_layers)
    config = tiny_gpt_config(tp, pp, cp, vpp, options)
    chunks = [
        _build_chunk(config, options, stage, megatron_attention) for stage in _vp_stages(vpp)
    ]
    for chunk in chunks:
        mark_gdn_tp_blocks(chunk)
        init_from_global_names(chunk, options.seed)
    return chunks


def _vp_stages(vpp: Optional[int]) -> list[Optional[int]]:
    return [None] if vpp is None else list(range(vpp))


def _build_chunk(
    config: TransformerConfig,
    options: TinyGPTOptions,
    stage: Optional[int],
    megatron_attention: bool = False,
) -> GPTModel:
    if options.hybrid_layer_pattern:
        return build_hybrid_chunk(config, options, stage)
    ignore_virtual = stage is None
    if megatron_attention and (options.multi_latent_attention or options.linear_attention_freq):
        raise ValueError("megatron_attention builds the dense and MoE GPT only")
    if megatron_attention:
        layer_spec = get_gpt_layer_local_spec(
            num_experts=options.num_moe_experts, moe_grouped_gemm=False
        )
    elif options.multi_latent_attention:  # the CPU backend's own spec (MLA from local modules)
        layer_spec = local_transformer_spec(config, stage)
    elif options.linear_attention_freq:
        layer_spec = gdn_layer_spec(config, stage)
    else:
        layer_spec = reference_layer_spec(
            num_experts=options.num_moe_experts, moe_grouped_gemm=False
        )
    mtp_spec = None
    if options.mtp_layers:
        mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, False, vp_stage=stage)
        mtp_spec = with_core_attention(mtp_spec)  # the MTP layers copy the decoder's layer spec
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=options.vocab_size,
        max_sequence_length=options.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual, vp_stage=stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual, vp_stage=stage),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=mtp_spec,
        vp_stage=stage,
    )


def global_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> name in the single-process model (PP stages renumber layers)."""
    model = unwrap(model)
    names = {}
    for name, _ in model.named_parameters():
        names[name] = global_expert_name(renumbered(model, name), model.config.num_moe_experts)
    return names


def _full_shape(param: torch.Tensor) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= dist.get_world_size(tensor_parallel_group(param))
    return shape


def _full_init(global_name: str, shape: list[int], seed: int) -> torch.Tensor:
    """The full tensor of a parameter: a function of its global name and the seed only."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
    values = torch.randn(shape, generator=generator)
    if len(shape) == 1 and "norm" in global_name:
        return 1.0 + 0.1 * values
    return 0.1 * values


def _tp_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    group, dim = tensor_parallel_group(param), param.partition_dim
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    blocks = getattr(param, "partition_sizes", None)  # Mamba: each block split over TP
    parts = full.split([b * size for b in blocks], dim) if blocks else [full]
    return torch.cat([part.chunk(size, dim)[rank] for part in parts], dim)


@torch.no_grad()
def init_from_global_names(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with this rank's shard of its name-determined full tensor."""
    names = global_parameter_names(model)
    for name, param in unwrap(model).named_parameters():
        full = _full_init(names[name], _full_shape(param), seed)
        param.copy_(_tp_shard(full, param))


def _param_grad(param: torch.Tensor) -> torch.Tensor:
    return parameter_gradient(param).detach()


def _gather_tp(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    group = tensor_parallel_group(param)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    dim, blocks = param.partition_dim, getattr(param, "partition_sizes", None)
    if not blocks:
        return torch.cat(parts, dim)
    split = [part.split(blocks, dim) for part in parts]
    return torch.cat([torch.cat(column, dim) for column in zip(*split)], dim)


def _sum_sequence_parallel(grad: torch.Tensor, param: torch.Tensor) -> None:
    """Under sequence parallelism each TP rank's norm and row-parallel bias gradients cover its
    own tokens (megatron marks those parameters ``sequence_parallel``; finalize_model_grads
    sums them over TP, which a step without DDP does not run)."""
    if getattr(param, "sequence_parallel", False):
        dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())


def gather_full_tensors(
    chunks: Sequence[torch.nn.Module],
    select: Callable[[torch.Tensor], torch.Tensor] = _param_grad,
    reduce_dp_cp: bool = True,
) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors by global name, on every rank: ``select(param)`` (default: the
    gradient, ``main_grad`` under DDP), summed over the DP×CP group when ``reduce_dp_cp`` (each
    rank's gradient covers its own tokens; under sequence parallelism also over TP for the
    parameters marked ``sequence_parallel``; expert-parallel experts over the ranks holding
    them, then collected from every EP rank), gathered over TP and merged over PP. A name present on
    several PP stages (embedding copies) is summed. Collective over the whole world."""
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        names = global_parameter_names(chunk)
        for name, param in unwrap(chunk).named_parameters():
            tensor = select(param).clone()
            if reduce_dp_cp:
                dist.all_reduce(tensor, group=gradient_sum_group(param))
                _sum_sequence_parallel(tensor, param)
            local[names[name]] = _gather_tp(tensor, param)
    return _merge_pipeline_stages(merge_expert_parallel(local))


def _merge_pipeline_stages(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    group = parallel_state.get_pipeline_model_parallel_group()
    stages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, local, group=group)
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, tensor in stage.items():
            merged[name] = merged[name] + tensor if name in merged else tensor
    return merged


def packed_loss_and_backward(
    model: torch.nn.Module, samples: Sequence[Sample], tp: int = 1
) -> tuple[torch.Tensor, int]:
    """Forward + backward of one packed micro-batch on the static CP group (no PP): this rank's
    summed loss (detached) and loss-carrying token count."""
    cp_group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    packed = pack_samples(samples, cp_size, cp_rank, padding_multiple(cp_size, tp))
    losses = packed_token_losses(model, packed, packed_seq_params_of(packed, None, dynamic=False))
    loss = (losses * packed.loss_mask).sum()
    loss.backward()
    return loss.detach(), packed.num_tokens


def packed_token_losses(
    model: torch.nn.Module, packed: Any, packed_seq_params: Any
) -> torch.Tensor:
    """Per-token losses ``[1, T_local]`` of one packed micro-batch (``PackedMicroBatch``)."""
    return model(
        input_ids=packed.tokens,
        position_ids=packed.position_ids,
        attention_mask=None,
        labels=packed.labels,
        loss_mask=packed.loss_mask,
        packed_seq_params=packed_seq_params,
    )


def unpacked_token_losses(model: torch.nn.Module, sample: Sample) -> torch.Tensor:
    """Per-token losses ``[1, L]`` of one non-empty sample run on its own (sbhd, no CP)."""
    return model(
        input_ids=sample["tokens"].view(1, -1),
        position_ids=torch.arange(sample["tokens"].numel()).view(1, -1),
        attention_mask=None,
        labels=sample["labels"].view(1, -1),
    )


def unpacked_loss_and_backward(
    model: torch.nn.Module, samples: Sequence[Sample]
) -> tuple[float, int]:
    """The oracle: every sample on its own (sbhd, batch 1, no padding, no CP); summed loss over
    samples and token count, gradients accumulated."""
    total, tokens = 0.0, 0
    for sample in samples:
        if sample["tokens"].numel() == 0:
            continue
        loss = (unpacked_token_losses(model, sample) * sample["loss_mask"].view(1, -1)).sum()
        loss.backward()
        total += loss.item()
        tokens += int((sample["loss_mask"] != 0).sum())
    return total, tokens


LossAndBackward = Callable[[torch.nn.Module, Sequence[Sample]], tuple[float, int]]


def reference_passes(
    samples: Sequence[Sample],
    options: TinyGPTOptions,
    before_pass: Callable[[], None] = lambda: None,
    run: Optional[LossAndBackward] = None,
) -> ReferenceResult:
    """The oracle in this process (after ``init_megatron``), three times on fresh models: in
    float64, in float32 on the samples in reverse order, and in float32 as given (last, so that
    state a pass leaves behind, such as megatron's MoE loss tracker, is the float32 run's;
    ``before_pass`` runs before each, e.g. to clear it). ``run``: the forward-backward of the
    samples (default: each on its own, ``unpacked_loss_and_backward``). The float32 run is the
    result, the other two measure its rounding (``ExactRun``)."""
    run = run or unpacked_loss_and_backward
    before_pass()
    exact_loss, _, exact = _reference_pass(samples, options, run, to_float64)
    before_pass()
    reordered_loss, _, reordered = _reference_pass(samples[::-1], options, run)
    before_pass()
    loss_sum, num_tokens, grads = _reference_pass(samples, options, run)
    runs = [(loss_sum, grads), (reordered_loss, reordered)]
    return ReferenceResult(loss_sum, num_tokens, grads, exact_run(exact_loss, exact, runs))


def _reference_pass(
    samples: Sequence[Sample],
    options: TinyGPTOptions,
    run: LossAndBackward,
    convert: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model,
) -> tuple[float, int, dict[str, torch.Tensor]]:
    (model,) = build_tiny_gpt(options=options)
    loss_sum, num_tokens = run(convert(model), samples)
    return float(loss_sum), num_tokens, gather_full_tensors([model])


def _reference_worker(
    rank: int, world_size: int, samples: Sequence[Sample], options: TinyGPTOptions
) -> ReferenceResult:
    init_megatron(seed=options.seed)
    return reference_passes(list(samples), options)


def single_process_reference(
    samples: Sequence[Sample], options: Optional[TinyGPTOptions] = None
) -> ReferenceResult:
    """Summed loss, token count and full gradients of the tiny GPT on ``samples``, one process,
    no parallelism, no packing (run in a one-rank job so the caller's state is untouched)."""
    (result,) = run_distributed(_reference_worker, 1, list(samples), options or TinyGPTOptions())
    return result


# ------------------------------------------------------------------------------------------------
# The oracle of a mixed-precision run (bf16, or fp16 with a loss scale)
# ------------------------------------------------------------------------------------------------


def with_half(options: TinyGPTOptions) -> TinyGPTOptions:
    """``options`` naming the half precision of a mixed-precision run: their own, or bf16 for
    options that name none (the mixed-precision step and oracle take plain model options)."""
    if options.half_precision:
        return options
    return dataclasses.replace(options, half_precision="bf16")


def half_weights(model: torch.nn.Module, half: torch.dtype, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` holding the weights a run in ``half`` starts from (its initial values rounded to
    ``half``, as megatron's Float16Module does), computing in ``dtype``: the float64 pass then
    computes exactly what the half run approximates, not the effect of rounding the weights."""
    return to_dtype(model.to(half), dtype)


def mixed_precision_model(options: TinyGPTOptions, dtype: torch.dtype) -> GPTModel:
    """The oracle's model, on one rank: megatron's GPT with megatron's own attention (none of
    this package's), holding :func:`half_weights` of ``options``' half precision
    (:func:`with_half`), computing in ``dtype``. In the half type it is built as megatron builds
    it for ``--bf16`` or ``--fp16`` (``config.bf16``/``config.fp16``: e.g. its softmax then
    upcasts the half scores to float32, as on a GPU); in float64 and float32 from the float32
    build."""
    options = with_half(options)
    half = options.params_dtype
    built = options if dtype == half else dataclasses.replace(options, half_precision=None)
    (model,) = build_tiny_gpt(options=built, megatron_attention=True)
    return half_weights(model, half, dtype)


def mixed_precision_pass(
    samples: Sequence[Sample], options: TinyGPTOptions, dtype: torch.dtype
) -> tuple[float, int, dict[str, torch.Tensor]]:
    """The oracle run of :func:`mixed_precision_model` as megatron's mixed-precision recipe
    computes it (:func:`mixed_precision_backward`; in fp16 with the loss scale megatron's run
    starts from: ``precision.loss_scale_of``); in float64 everything is float64. Summed loss,
    token count and the summed gradients (of the loss, unscaled) by global name."""
    model = mixed_precision_model(options, dtype)
    summing = torch.float64 if dtype == torch.float64 else torch.float32
    sums = {name: torch.zeros_like(p, dtype=summing) for name, p in model.named_parameters()}
    total, tokens = mixed_precision_backward(model, samples, sums, loss_scale_of(dtype))
    names = global_parameter_names(model)
    return total, tokens, {names[name]: grad for name, grad in sums.items()}


def mixed_precision_backward(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    sums: dict[str, torch.Tensor],
    loss_scale: float = 1.0,
) -> tuple[float, int]:
    """Every non-empty sample on its own through ``model`` (sbhd, batch 1, no padding, no CP),
    as megatron's mixed-precision recipe computes: parameters and compute in the model's dtype,
    the loss in the sums' dtype (megatron's cross entropy upcasts half logits to float32), each
    sample's gradient (in the model's dtype) added to ``sums`` (by local parameter name), as
    megatron's DDP adds each micro-batch's gradient to its float32 ``main_grad``. fp16's
    ``loss_scale``: the loss multiplied by it before backward, so that small gradients stay
    above fp16's subnormals as megatron's loss scaler keeps them, and each sample's gradient
    divided by it as it is added (megatron unscales the float32 sum: the same for a power of
    two). Summed loss (unscaled) and token count."""
    summing = next(iter(sums.values())).dtype
    total, tokens = 0.0, 0
    for sample in samples:
        if sample["tokens"].numel() == 0:
            continue
        losses = unpacked_token_losses(model, sample).to(summing)
        loss = (losses * sample["loss_mask"].view(1, -1).to(summing)).sum()
        (loss * loss_scale).backward()
        add_gradients(model, sums, summing, loss_scale)
        total += float(loss)
        tokens += int((sample["loss_mask"] != 0).sum())
    return total, tokens


def leave_the_runtime() -> None:
    """Make this oracle process run none of DCP's code, and check it: only the CPU stand-ins of
    the patch table stay applied. The process is a fork of the test process, which an earlier
    test may have left with DCP's entries applied; restoring them here leaves the parent as it
    was."""
    from megatron_dcp.integration.patches import restore_groups
    from megatron_dcp.tools.check.reference_arm import RUNTIME_GROUPS, outside_runtime

    restore_groups(RUNTIME_GROUPS)
    outside_runtime()


def _mixed_precision_worker(
    rank: int, world_size: int, samples: Sequence[Sample], options: TinyGPTOptions
) -> ReferenceResult:
    init_megatron(seed=options.seed)
    leave_the_runtime()
    half = with_half(options).params_dtype
    exact_loss, _, exact = mixed_precision_pass(samples, options, torch.float64)
    reordered_loss, _, reordered = mixed_precision_pass(samples[::-1], options, half)
    loss_sum, num_tokens, grads = mixed_precision_pass(samples, options, half)
    runs = [(loss_sum, grads), (reordered_loss, reordered)]
    return ReferenceResult(loss_sum, num_tokens, grads, exact_run(exact_loss, exact, runs))


def mixed_precision_reference(
    samples: Sequence[Sample], options: Optional[TinyGPTOptions] = None
) -> ReferenceResult:
    """The oracle of a mixed-precision step in ``options``' half precision (bf16 if none; one
    process, no parallelism, no packing, no Float16Module and no loss scaler of megatron's:
    megatron's model itself): the half run as ``grads``; ``exact``, the same samples in float64
    with what the half run in two sample orders differs from it by."""
    options = options or TinyGPTOptions()
    (result,) = run_distributed(_mixed_precision_worker, 1, list(samples), options)
    return result


def make_samples(lengths: Sequence[int], vocab_size: int = 128, seed: int = 0) -> list[Sample]:
    """Random samples (labels = next token, a few masked positions) of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for length in lengths:
        stream = torch.randint(1, vocab_size, (length + 1,), generator=generator)
        loss_mask = (torch.rand(length, generator=generator) > 0.1).float()
        samples.append({"tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask})
    return samples
