"""The forward step of a GPT model on DCP micro-batches, with a per-token loss."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, Tuple

import torch


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
