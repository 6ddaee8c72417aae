"""A DCP training step of the tiny GPT through megatron's real pipeline schedules, as a
``run_distributed`` worker, with what the oracle tests compare: the global summed loss, token
count and full gradients (see ``testing.gpt.single_process_reference``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dcp.integration.dcp import build_forward_backward
from megatron_dcp.integration.gpt_step import forward_step
from megatron_dcp.integration.patches import apply_patches
from megatron_dcp.testing.gpt import (
    Sample,
    TinyGPTOptions,
    build_tiny_gpt,
    gather_full_tensors,
    init_megatron,
)


@dataclass(frozen=True)
class DCPStepResult:
    loss_sum: float
    num_tokens: int
    cp_sizes: tuple[int, ...]
    num_microbatches: int
    grads: dict[str, torch.Tensor] = field(repr=False)


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
) -> DCPStepResult:
    """One forward-backward of ``samples`` (the global batch, split evenly over DP ranks)."""
    from megatron.core import parallel_state

    options = options or TinyGPTOptions()
    init_megatron(tp, pp, cp, vpp, seed=options.seed)
    apply_patches()
    chunks = build_tiny_gpt(tp, pp, cp, vpp, options=options)
    wrapper = build_forward_backward(chunks[0].config, budget, scheduler, min_cp_size)
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
        loss_sum, num_tokens, tuple(stats.cp_size_histogram), stats.num_microbatches, grads
    )


def global_loss(losses: Sequence[dict]) -> tuple[float, int]:
    """Summed loss and token count of the global batch, on every rank: summed over micro-batches
    and the DP×CP domain on the last pipeline stage, then broadcast along the pipeline."""
    from megatron.core import parallel_state

    total = torch.zeros(2, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for entry in losses:
            total += entry["lm loss"].double()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last = dist.get_process_group_ranks(pp_group)[-1]
    dist.broadcast(total, src=last, group=pp_group)
    return total[0].item(), int(total[1].item())
