"""A DCP training step of the tiny GPT through megatron's real pipeline schedules, as a
``run_distributed`` worker, with what the oracle tests compare: the global summed loss, token
count and full gradients (see ``testing.gpt.single_process_reference``); the same in megatron's
mixed precision, bf16 or fp16 with its loss scaler (:func:`dcp_mixed_precision_step`), and training
runs of a few Adam steps with their single-process oracles, in float32, bf16 and fp16."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.integration.forward_backward import build_forward_backward
from megatron_dcp.integration.patches import apply_patches
from megatron_dcp.integration.training.forward_step import forward_step, global_loss
from megatron_dcp.runtime.pack_padding import NO_PADDING, PackPadding
from megatron_dcp.scheduling import CostModel
from megatron_dcp.testing.gpt import (
    Sample,
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    half_weights,
    init_megatron,
    leave_the_runtime,
    mixed_precision_backward,
    mixed_precision_model,
    unpacked_loss_and_backward,
    with_half,
)
from megatron_dcp.testing.overlap import (
    NO_OVERLAP,
    CommOverlap,
    ddp_config_fields,
    finish_param_gather,
    install_schedule_hooks,
    use_p2p_overlap,
)
from megatron_dcp.testing.plan_coverage import Layout, parallel_layout
from megatron_dcp.testing.precision import (
    FP16_LOSS_SCALE,
    HALF_DTYPES,
    ExactRun,
    RanPrecision,
    exact_run,
    loss_scale_of,
    ran_precision,
    to_float64,
)


@dataclass(frozen=True)
class DCPStepResult:
    """What one rank computed, and what the step ran (``testing.plan_coverage``): the CP sizes
    of the plan, its micro-batch count and the layout; ``precision``: what it computed in (a
    step through DDP: :func:`dcp_mixed_precision_step`)."""

    loss_sum: float
    num_tokens: int
    cp_sizes: tuple[int, ...]
    num_microbatches: int
    grads: dict[str, torch.Tensor] = field(repr=False)
    layout: Layout
    precision: Optional[RanPrecision] = None


def dcp_training_step(
    rank: int,
    world_size: int,
    samples: Sequence[Sample],
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: Optional[int] = None,
    scheduler: str = "default_dynamic_cp",
    budget: int = 64,
    min_cp_size: int = 1,
    options: Optional[TinyGPTOptions] = None,
    overlap: CommOverlap = NO_OVERLAP,
    cost_model: Optional[CostModel] = None,
    pack_padding: PackPadding = NO_PADDING,
) -> DCPStepResult:
    """One forward-backward of ``samples`` (the global batch, split evenly over DP ranks);
    ``overlap``: its p2p settings (``testing.overlap``; a step without DDP has no others);
    ``cost_model``: what the scheduler plans with (default: the model's on this backend);
    ``pack_padding``: the padding of each rank's pack (Megatron dev's packing flags)."""
    options = options or TinyGPTOptions()
    init_model_parallel(tp, pp, cp, vpp, options)
    apply_patches()
    chunks = build_tiny_gpt(tp, pp, cp, vpp, options=options)
    use_p2p_overlap(chunks[0].config, overlap)
    dcp = DCPConfig.for_model(
        chunks[0].config,
        budget,
        scheduler=scheduler,
        min_cp_size=min_cp_size,
        cost_model=cost_model,
        pack_padding=pack_padding,
    )
    wrapper = build_forward_backward(chunks[0].config, dcp)
    losses = forward_backward_of(wrapper, chunks, local_share(samples), vpp)
    return step_result(wrapper, losses, chunks)


def step_result(
    wrapper: Any, losses: Any, chunks: Sequence[torch.nn.Module]
) -> DCPStepResult:
    """What a step through ``wrapper`` computed (megatron's ``losses``, the full gradients of
    ``chunks``) and ran; its DCP groups destroyed."""
    loss_sum, num_tokens = global_loss(losses)
    stats = wrapper.stats[-1]
    grads = gather_full_tensors(chunks)
    wrapper.groups.destroy()
    return DCPStepResult(
        loss_sum,
        num_tokens,
        tuple(stats.cp_size_histogram),
        stats.num_microbatches,
        grads,
        parallel_layout(),
    )


def forward_backward_of(
    wrapper: Callable, models: Sequence[torch.nn.Module], local: Sequence[Sample], vpp: Any
) -> Any:
    """One forward-backward of this rank's ``local`` samples through the DCP ``wrapper`` over
    ``models`` (the model chunks, one data iterator each with VPP); megatron's losses."""
    return wrapper(
        forward_step_func=forward_step,
        data_iterator=[iter(local) for _ in models] if vpp else iter(local),
        model=list(models) if vpp else models[0],
        num_microbatches=len(local),
    )


def local_share(samples: Sequence[Sample]) -> list[Sample]:
    """This DP rank's share of the global batch (split evenly, in order)."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    share = len(samples) // parallel_state.get_data_parallel_world_size()
    return list(samples[dp_rank * share : (dp_rank + 1) * share])


def dcp_mixed_precision_step(
    rank: int,
    world_size: int,
    samples: Sequence[Sample],
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    scheduler: str = "default_dynamic_cp",
    budget: int = 64,
    options: Optional[TinyGPTOptions] = None,
) -> DCPStepResult:
    """One forward-backward as megatron.training runs it with ``--bf16`` (``--fp16``:
    ``options.half_precision``, bf16 if none): the chunks built in the half type, in megatron's
    Float16Module and DDP with float32 gradient accumulation (``grad_reduce_in_fp32``), the
    mixed-precision optimizer built (not stepped) whose ``scale_loss`` the schedule scales the
    loss by (fp16's loss scale; 1 in bf16), megatron's ``finalize_model_grads`` at the end of the
    schedule. ``grads``: the float32 ``main_grad`` afterwards over the loss scale, i.e. summed
    over DP×CP and divided by the global token count (the gradient of the per-token loss: compare
    with the oracle's over ``num_tokens``); ``precision``: what the step computed in."""
    options = with_half(options or TinyGPTOptions())
    init_model_parallel(tp, pp, cp, None, options)
    apply_patches()
    chunks = build_tiny_gpt(tp, pp, cp, options=options)
    models, optimizer = with_ddp_and_adam(chunks)
    scale = float(optimizer.get_loss_scale())
    dcp = DCPConfig.for_model(chunks[0].config, budget, scheduler=scheduler)
    wrapper = build_forward_backward(chunks[0].config, dcp)
    models[0].zero_grad_buffer()
    losses = forward_backward_of(wrapper, models, local_share(samples), vpp=None)
    loss_sum, num_tokens = global_loss(losses)
    stats = wrapper.stats[-1]
    unscaled = lambda param: main_grad(param) / scale  # noqa: E731
    grads = gather_full_tensors(chunks, select=unscaled, reduce_dp_cp=False)
    wrapper.groups.destroy()
    sizes = tuple(stats.cp_size_histogram)
    layout = parallel_layout()
    precision = ran_precision(models, optimizer)
    return DCPStepResult(
        loss_sum, num_tokens, sizes, stats.num_microbatches, grads, layout, precision
    )


def main_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient megatron's DDP accumulated and finalised for ``param``."""
    return param.main_grad.detach()


def init_model_parallel(
    tp: int, pp: int, cp: int, vpp: Optional[int], options: TinyGPTOptions
) -> None:
    """megatron's parallel state for the layout and ``options``' model (seed, expert layout)."""
    ep, etp = options.expert_parallel, options.expert_tensor_parallel
    init_megatron(tp, pp, cp, vpp, seed=options.seed, ep=ep, etp=etp)


# ------------------------------------------------------------------------------------------------
# Several optimizer steps: DDP + Adam through megatron's finalize_model_grads
# ------------------------------------------------------------------------------------------------

LEARNING_RATE = 1e-2
ADAM_EPS = 1e-8  # megatron's default


def with_ddp(
    chunks: Sequence[torch.nn.Module],
    distributed_optimizer: bool = False,
    overlap: CommOverlap = NO_OVERLAP,
) -> list:
    """Wrap ``chunks`` in megatron DDP (gradients summed over DP×CP: per-token loss); the
    schedules then sync and scale gradients by the global token count. Chunks built for bf16 or
    fp16 (``config.bf16``, ``config.fp16``) go into megatron's Float16Module first and accumulate
    their gradients in float32 (``grad_reduce_in_fp32``), as megatron.training's ``get_model``
    does with ``--bf16``, and with ``--fp16 --accumulate-allreduce-grads-in-fp32`` (fp16 sums its
    micro-batches and DP×CP ranks as bf16 does, which is what the oracle emulates).
    ``distributed_optimizer``: gradients reduce-scattered for a sharded optimizer.
    ``overlap``: megatron's communication overlaps, with the schedule hooks megatron.training
    installs for them (``testing.overlap``)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    config = chunks[0].config
    half = _half_precision(config) is not None
    if half:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer,
        grad_reduce_in_fp32=half,
        **ddp_config_fields(overlap),
    )
    models = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    install_schedule_hooks(models, overlap)
    return models


def with_ddp_and_adam(
    chunks: Sequence[torch.nn.Module],
    distributed_optimizer: bool = False,
    overlap: CommOverlap = NO_OVERLAP,
    adam_eps: float = ADAM_EPS,
) -> tuple[list, object]:
    """:func:`with_ddp` and megatron's Adam. ``distributed_optimizer``: Adam's state sharded over
    DP×CP (gradients reduce-scattered, parameters all-gathered). For bf16 and fp16 chunks
    megatron's mixed-precision optimizer: float32 main copies of the half parameters, updated from
    the float32 gradients and copied back (``Float16OptimizerWithFloat16Params``, or the
    distributed optimizer's sharded main copies); for fp16 with megatron's dynamic loss scaler
    from :data:`~megatron_dcp.testing.precision.FP16_LOSS_SCALE`, which unscales the gradients and
    skips a step whose gradients overflowed. As megatron.training sets it up, the optimizer's
    ``scale_loss`` is the schedules' ``grad_scale_func`` (1 without a scaler). ``adam_eps``:
    Adam's epsilon."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    models = with_ddp(chunks, distributed_optimizer, overlap)
    config = chunks[0].config
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=LEARNING_RATE,
        adam_eps=adam_eps,
        weight_decay=0.0,
        clip_grad=0.0,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=HALF_DTYPES.get(_half_precision(config), torch.float32),
        loss_scale=None,  # fp16: the dynamic scaler
        initial_loss_scale=FP16_LOSS_SCALE,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=overlap.param_gather,
    )
    optimizer = get_megatron_optimizer(optimizer_config, models)
    config.grad_scale_func = optimizer.scale_loss
    return models, optimizer


def _half_precision(config: Any) -> Optional[str]:
    """The half precision a megatron config computes in ("bf16", "fp16"; None: float32)."""
    return "bf16" if config.bf16 else "fp16" if config.fp16 else None


def full_weights(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return gather_full_tensors(chunks, select=lambda p: p.detach(), reduce_dp_cp=False)


@dataclass(frozen=True)
class TrainingRunResult:
    """The full weights after a training run, and what it ran (``testing.plan_coverage``): the
    CP sizes and the micro-batch count of each global batch's plan, the layout and what it
    computed in (``precision``); ``updates``: whether each optimizer step updated the weights
    (megatron's optimizer skips a step whose fp16 gradients overflowed, and says so)."""

    weights: dict[str, torch.Tensor] = field(repr=False)
    cp_sizes: tuple[tuple[int, ...], ...]
    num_microbatches: tuple[int, ...]
    layout: Layout
    precision: Optional[RanPrecision] = None
    updates: tuple[bool, ...] = ()


def dcp_training_run(
    rank: int,
    world_size: int,
    batches: Sequence[Sequence[Sample]],
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    budget: int = 64,
    options: Optional[TinyGPTOptions] = None,
    distributed_optimizer: bool = False,
    vpp: Optional[int] = None,
    overlap: CommOverlap = NO_OVERLAP,
    adam_eps: float = ADAM_EPS,
) -> TrainingRunResult:
    """``len(batches)`` DCP training steps (DDP + Adam, megatron's distributed optimizer when
    ``distributed_optimizer``, the communication overlaps of ``overlap``; in megatron's mixed
    precision with ``options.half_precision``, fp16 with its loss scaler; Adam's epsilon
    ``adam_eps``); the full weights afterwards and what the steps ran."""
    options = options or TinyGPTOptions()
    init_model_parallel(tp, pp, cp, vpp, options)
    apply_patches()
    chunks = build_tiny_gpt(tp, pp, cp, vpp, options=options)
    models, optimizer = with_ddp_and_adam(chunks, distributed_optimizer, overlap, adam_eps)
    wrapper = build_forward_backward(
        chunks[0].config, DCPConfig.for_model(chunks[0].config, budget)
    )
    updates = []
    for samples in batches:
        for model in models:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward_of(wrapper, models, local_share(samples), vpp)
        update_successful, _, _ = optimizer.step()
        updates.append(bool(update_successful))
    finish_param_gather(models, overlap)
    wrapper.groups.destroy()
    sizes = tuple(tuple(stats.cp_size_histogram) for stats in wrapper.stats)
    counts = tuple(stats.num_microbatches for stats in wrapper.stats)
    precision = ran_precision(models, optimizer)
    layout = parallel_layout()
    return TrainingRunResult(full_weights(chunks), sizes, counts, layout, precision, tuple(updates))


def reference_training_run(
    rank: int, world_size: int, batches: Sequence[Sequence[Sample]], options: TinyGPTOptions
) -> ExactRun:
    """The oracle of ``dcp_training_run``: one process, samples one by one (no packing, no CP),
    the same DDP, token-count scaling and Adam; the weights afterwards in float64, with what the
    same run in float32 differs from them by (each batch's samples in two orders; see
    ``testing.precision``)."""
    init_megatron(seed=options.seed)
    exact = _reference_training_pass(batches, options, to_float64)
    no_loss = 0.0  # weights only: the ExactRun's loss fields stay 0 and are not compared
    float32_runs = [
        (no_loss, _reference_training_pass([batch[::-1] for batch in batches], options)),
        (no_loss, _reference_training_pass(batches, options)),
    ]
    return exact_run(no_loss, exact, float32_runs)


def _reference_training_pass(
    batches: Sequence[Sequence[Sample]],
    options: TinyGPTOptions,
    convert: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model,
    adam_eps: float = ADAM_EPS,
    megatron_attention: bool = False,
) -> dict[str, torch.Tensor]:
    from megatron.core.distributed import finalize_model_grads

    built = build_tiny_gpt(options=options, megatron_attention=megatron_attention)
    chunks = [convert(chunk) for chunk in built]
    models, optimizer = with_ddp_and_adam(chunks, adam_eps=adam_eps)
    for samples in batches:
        models[0].zero_grad_buffer()
        optimizer.zero_grad()
        _, num_tokens = unpacked_loss_and_backward(models[0], samples)
        finalize_model_grads(models, num_tokens=torch.tensor(num_tokens))
        optimizer.step()
    return full_weights(chunks)


def mixed_precision_reference_training_run(
    rank: int,
    world_size: int,
    batches: Sequence[Sequence[Sample]],
    options: TinyGPTOptions,
    adam_eps: float = ADAM_EPS,
) -> ExactRun:
    """The oracle of ``dcp_training_run`` in mixed precision (``options.half_precision``, bf16
    if none): one process, samples one by one, megatron's model with its own attention
    (``gpt.mixed_precision_model``), no Float16Module, no loss scaler and no mixed-precision
    optimizer of megatron's. The exact run: the float64 one of :func:`reference_training_run`,
    from the half starting weights. The half runs (each batch's samples in two orders) emulate
    megatron's recipe on two plain models: a half copy of float32 main weights computes each
    sample (``gpt.mixed_precision_backward``; in fp16 the loss scaled by the scale megatron's
    scaler starts from, each gradient unscaled), its gradient is added to the main weights'
    float32 ``main_grad``, megatron's float32 DDP and Adam scale and apply them to the main
    weights, and the half copy takes them up (rounded) before the next batch. The half copy's
    weights are the result: what a mixed-precision run's model holds."""
    init_megatron(seed=options.seed)
    leave_the_runtime()
    options = with_half(options)
    single = dataclasses.replace(options, half_precision=None)
    to_exact = lambda model: half_weights(model, options.params_dtype, torch.float64)  # noqa: E731
    exact = _reference_training_pass(batches, single, to_exact, adam_eps, True)
    no_loss = 0.0  # weights only, as in reference_training_run
    reordered = [batch[::-1] for batch in batches]
    runs = [
        (no_loss, _mixed_training_pass(order, options, adam_eps)) for order in (reordered, batches)
    ]
    return exact_run(no_loss, exact, runs)


def _mixed_training_pass(
    batches: Sequence[Sequence[Sample]], options: TinyGPTOptions, adam_eps: float
) -> dict[str, torch.Tensor]:
    """One half run of :func:`mixed_precision_reference_training_run` (``options`` name the
    half precision)."""
    from megatron.core.distributed import finalize_model_grads

    half = options.params_dtype
    single = dataclasses.replace(options, half_precision=None)
    (main,) = build_tiny_gpt(options=single, megatron_attention=True)
    main = half_weights(main, half, torch.float32)
    models, optimizer = with_ddp_and_adam([main], adam_eps=adam_eps)
    compute = mixed_precision_model(options, half)
    main_params = dict(main.named_parameters())
    for samples in batches:
        models[0].zero_grad_buffer()
        optimizer.zero_grad()
        _take_up(compute, main_params)
        sums = {name: param.main_grad for name, param in main_params.items()}
        _, num_tokens = mixed_precision_backward(compute, samples, sums, loss_scale_of(half))
        finalize_model_grads(models, num_tokens=torch.tensor(num_tokens))
        optimizer.step()
    _take_up(compute, main_params)
    return full_weights([compute])


@torch.no_grad()
def _take_up(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """``model``'s parameters set to ``weights`` (by name), rounded to the model's dtype."""
    for name, param in model.named_parameters():
        param.copy_(weights[name])
