"""The forward step of a GPT model on DCP micro-batches, with a per-token loss, and the global
loss of a step from its micro-batches' reports."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dcp.runtime.exchange import collective_device


def forward_step(data_iterator: Iterator[Dict[str, Any]], model: Any) -> Tuple[Any, Callable]:
    """Run ``model`` on the next DCP micro-batch (see ``integration.forward_backward.batch_of``)."""
    batch = next(data_iterator)
    output = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        packed_seq_params=batch["packed_seq_params"],
    )
    return output, partial(per_token_loss, batch["loss_mask"])


def per_token_loss(loss_mask: torch.Tensor, losses: torch.Tensor) -> Tuple[Any, ...]:
    """Sum of this rank's token losses and its token count (megatron divides the gradients by the
    global count); ``lm loss`` reports both so the logged loss is the global token mean."""
    loss_sum = (losses.float().view(-1) * loss_mask.view(-1)).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def global_loss(reports: Sequence[Dict[str, torch.Tensor]]) -> Tuple[float, int]:
    """Summed loss and token count of the global batch, on every rank, from the ``lm loss``
    reports a schedule call returned (:func:`per_token_loss`'s, one per micro-batch, on the last
    pipeline stage only): summed over micro-batches and the DP×CP domain (float64), then
    broadcast along the pipeline."""
    from megatron.core import parallel_state

    domain = parallel_state.get_data_parallel_group(with_context_parallel=True)
    total = torch.zeros(2, dtype=torch.float64, device=collective_device(domain))
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for entry in reports:
            total += entry["lm loss"].double().to(total.device)
        dist.all_reduce(total, group=domain)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last = dist.get_process_group_ranks(pp_group)[-1]
    dist.broadcast(total, src=last, group=pp_group)
    return total[0].item(), int(total[1].item())


def vlm_forward_step(data_iterator: Iterator[Dict[str, Any]], model: Any) -> Tuple[Any, Callable]:
    """Run a vision-language model (``integration.vlm_model.DCPLLaVAModel``) on the next DCP
    micro-batch: its text in combined coordinates, its image tiles and their slots."""
    batch = next(data_iterator)
    output, _ = model(
        images=batch["images"],
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=None,
        labels=batch["labels"],
        loss_mask=batch["loss_mask"],
        packed_seq_params=batch["packed_seq_params"],
        vision_slot=batch["vision_slot"],
        vision_share=batch["vision_share"],
    )
    return output, partial(per_token_loss, batch["loss_mask"])
