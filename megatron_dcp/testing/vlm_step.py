"""A DCP training step of the tiny LLaVA (``testing.vlm``) through megatron's schedule, as a
``run_distributed`` worker: what the oracle compares (global loss, token count, full gradients),
what the step ran (CP sizes, layout, the model's parts) and the encoder work of every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.integration.forward_backward import build_forward_backward
from megatron_dcp.integration.patches import apply_patches
from megatron_dcp.integration.training.forward_step import vlm_forward_step
from megatron_dcp.testing.dcp_step import (
    DCPStepResult,
    init_model_parallel,
    local_share,
    step_result,
)
from megatron_dcp.testing.vlm import TinyVLMOptions, build_tiny_vlm


@dataclass(frozen=True)
class VLMStepResult:
    """One rank's :class:`DCPStepResult`, the tiles each rank of the domain encoded (domain
    position order), the tiles of the batch, the most samples with images one CP group packed,
    and the model's parts (module class names)."""

    step: DCPStepResult
    encoder_tiles: Tuple[int, ...]
    batch_tiles: int
    image_samples_per_group: int
    parts: Tuple[str, ...]
    plan_patches: Tuple[int, ...] = ()  # the encoder patches the planner priced, per sample


def vlm_dcp_step(
    rank: int,
    world_size: int,
    samples: Sequence[dict],
    tp: int = 1,
    cp: int = 1,
    scheduler: str = "default_dynamic_cp",
    budget: int = 64,
    options: Optional[TinyVLMOptions] = None,
    routing: str = "auto",
) -> VLMStepResult:
    """One forward-backward of ``samples`` (the global batch, split evenly over DP ranks) through
    the DCP wrapper with the tiny LLaVA in a TP × CP layout (sequence parallelism as
    ``options.language`` says), samples and tiles routed by ``routing`` (``--dcp-routing``)."""
    options = options or TinyVLMOptions()
    init_model_parallel(tp, 1, cp, None, options.language)
    apply_patches()
    model = build_tiny_vlm(tp, cp, options)
    dcp = DCPConfig.for_model(model.config, budget, scheduler=scheduler, routing=routing)
    wrapper = build_forward_backward(model.config, dcp, vision=options.spec)
    local = local_share(samples)
    losses = wrapper(
        forward_step_func=vlm_forward_step,
        data_iterator=iter(local),
        model=model,
        num_microbatches=len(local),
    )
    step = step_result(wrapper, losses, [model])
    encoded = _domain_tiles(wrapper.stats[-1].encoder_tiles, wrapper.domain_group)
    tiles = [int(s["images"].shape[0]) for s in samples]
    packed = max(
        sum(1 for i in group.sample_ids if tiles[i])
        for microbatch in wrapper.plan.microbatches
        for group in microbatch.groups
    )
    return VLMStepResult(
        step, encoded, sum(tiles), packed, _parts(model), wrapper.plan.patches
    )


def _domain_tiles(local: int, domain_group: object) -> Tuple[int, ...]:
    """Every domain position's encoded tile count."""
    rows = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(domain_group))]
    dist.all_gather(rows, torch.tensor([local], dtype=torch.int64), group=domain_group)
    return tuple(int(row) for row in rows)


def _parts(model: torch.nn.Module) -> Tuple[str, ...]:
    """The classes of LLaVA's vision encoder, projector and language model, as built."""
    return tuple(
        type(getattr(model, name)).__name__
        for name in ("vision_model", "vision_projection", "language_model")
    )
