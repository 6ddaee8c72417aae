"""A DCP training step of the tiny GPT through megatron's real pipeline schedules, as a
``run_distributed`` worker, with what the oracle tests compare: the global summed loss, token
count and full gradients (see ``testing.gpt.single_process_reference``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

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
    init_megatron,
    unpacked_loss_and_backward,
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
from megatron_dcp.testing.precision import ExactRun, exact_run, to_float64


@dataclass(frozen=True)
class DCPStepResult:
    """What one rank computed, and what the step ran (``testing.plan_coverage``): the CP sizes
    of the plan, its micro-batch count and the layout."""

    loss_sum: float
    num_tokens: int
    cp_sizes: tuple[int, ...]
    num_microbatches: int
    grads: dict[str, torch.Tensor] = field(repr=False)
    layout: Layout


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
    from megatron.core import parallel_state

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
    dp_rank = parallel_state.get_data_parallel_rank()
    share = len(samples) // parallel_state.get_data_parallel_world_size()
    local = list(samples[dp_rank * share : (dp_rank + 1) * share])
    losses = wrapper(
        forward_step_func=forward_step,
        data_iterator=[iter(local) for _ in chunks] if vpp else iter(local),
        model=chunks if vpp else chunks[0],
        num_microbatches=share,
        seq_length=0,
        micro_batch_size=1,
        forward_only=False,
    )
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


def with_ddp_and_adam(
    chunks: Sequence[torch.nn.Module],
    distributed_optimizer: bool = False,
    overlap: CommOverlap = NO_OVERLAP,
) -> tuple[list, object]:
    """Wrap ``chunks`` in megatron DDP (gradients summed over DP×CP: per-token loss) and build
    megatron's Adam; the schedules then sync and scale gradients by the global token count.
    ``distributed_optimizer``: Adam's state sharded over DP×CP (gradients reduce-scattered,
    parameters all-gathered). ``overlap``: megatron's communication overlaps, with the schedule
    hooks megatron.training installs for them (``testing.overlap``)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, **ddp_config_fields(overlap)
    )
    models = [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    install_schedule_hooks(models, overlap)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=LEARNING_RATE,
        weight_decay=0.0,
        clip_grad=0.0,
        params_dtype=torch.float32,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=overlap.param_gather,
    )
    return models, get_megatron_optimizer(optimizer_config, models)


def full_weights(chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return gather_full_tensors(chunks, select=lambda p: p.detach(), reduce_dp_cp=False)


@dataclass(frozen=True)
class TrainingRunResult:
    """The full weights after a training run, and what it ran (``testing.plan_coverage``): the
    CP sizes and the micro-batch count of each global batch's plan, and the layout."""

    weights: dict[str, torch.Tensor] = field(repr=False)
    cp_sizes: tuple[tuple[int, ...], ...]
    num_microbatches: tuple[int, ...]
    layout: Layout


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
) -> TrainingRunResult:
    """``len(batches)`` DCP training steps (DDP + Adam, megatron's distributed optimizer when
    ``distributed_optimizer``, the communication overlaps of ``overlap``); the full weights
    afterwards and what the steps ran."""
    from megatron.core import parallel_state

    options = options or TinyGPTOptions()
    init_model_parallel(tp, pp, cp, vpp, options)
    apply_patches()
    chunks = build_tiny_gpt(tp, pp, cp, vpp, options=options)
    models, optimizer = with_ddp_and_adam(chunks, distributed_optimizer, overlap)
    wrapper = build_forward_backward(
        chunks[0].config, DCPConfig.for_model(chunks[0].config, budget)
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    for samples in batches:
        share = len(samples) // dp_size
        local = samples[dp_rank * share : (dp_rank + 1) * share]
        for model in models:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        wrapper(
            forward_step_func=forward_step,
            data_iterator=[iter(local) for _ in models] if vpp else iter(local),
            model=models if vpp else models[0],
            num_microbatches=share,
        )
        optimizer.step()
    finish_param_gather(models, overlap)
    wrapper.groups.destroy()
    sizes = tuple(tuple(stats.cp_size_histogram) for stats in wrapper.stats)
    counts = tuple(stats.num_microbatches for stats in wrapper.stats)
    return TrainingRunResult(full_weights(chunks), sizes, counts, parallel_layout())


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
) -> dict[str, torch.Tensor]:
    from megatron.core.distributed import finalize_model_grads

    chunks = [convert(chunk) for chunk in build_tiny_gpt(options=options)]
    models, optimizer = with_ddp_and_adam(chunks)
    for samples in batches:
        models[0].zero_grad_buffer()
        optimizer.zero_grad()
        _, num_tokens = unpacked_loss_and_backward(models[0], samples)
        finalize_model_grads(models, num_tokens=torch.tensor(num_tokens))
        optimizer.step()
    return full_weights(chunks)
