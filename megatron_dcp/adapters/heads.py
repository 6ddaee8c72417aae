"""A scalar output head for value models (critics) and reward models on megatron's GPT.

``attach_scalar_head(model)`` replaces the GPT's vocabulary projection by one output of width 1
per token: with ``labels=None`` the model then returns ``[1, T, 1]``, a value (critic) or a
score (reward model, read at each sample's last token: ``adapters.scores``). The head is a
plain ``[1, hidden]`` weight held whole on every tensor-parallel rank, so its output is the
same on every TP rank; under sequence parallelism it first gathers the sequence. Price such a
model's head as what it is, width 1 with no vocabulary projection:
``DCPConfig.for_model(model.config, budget, vocab_size=SCALAR_HEAD_WIDTH)``.

The adapter's value and score helpers read one number per token: :func:`scalar_outputs` takes
the head's width-1 axis off and refuses any other width, rather than keep column 0 of it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

SCALAR_HEAD_WIDTH = 1


class ScalarHead(torch.nn.Module):
    """``hidden → 1`` per token, called like megatron's output layer (``(output, bias)``)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(SCALAR_HEAD_WIDTH, hidden_size, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=hidden_size**-0.5)
        self.sequence_parallel = sequence_parallel

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Every TP rank computes the same loss on the whole sequence, so each one's gradient
            # is the whole gradient: the backward keeps this rank's slice (no reduce-scatter).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return torch.nn.functional.linear(hidden_states, self.weight), None


def scalar_outputs(output: torch.Tensor, token_dims: int, what: str) -> torch.Tensor:
    """``output`` as one number per token: ``[*tokens]`` as it is, ``[*tokens, 1]`` without its
    head axis (``token_dims``: how many leading axes index tokens). Any other per-token shape, a
    head wider than :data:`SCALAR_HEAD_WIDTH`, is refused: which column holds the value or the
    score is the caller's to say. ``what`` names the argument in the message."""
    if output.dim() <= token_dims:
        return output
    width = tuple(output.shape[token_dims:])
    if width == (SCALAR_HEAD_WIDTH,):
        return output[..., 0]
    raise ValueError(
        f"{what} has per-token shape {width}: a value or score head has width "
        f"{SCALAR_HEAD_WIDTH} (one number per token), and taking one column of a wider head "
        "would be a guess; use attach_scalar_head's head, or pass the column that holds the "
        "value or score (output[..., i:i + 1])"
    )


def attach_scalar_head(model: Any) -> Any:
    """Give megatron GPT ``model`` (unwrapped, before DDP) a :class:`ScalarHead` in place of its
    output layer, on the pipeline stage that has one; returns the model."""
    if not getattr(model, "post_process", False):
        return model
    if getattr(model, "share_embeddings_and_output_weights", False):
        raise ValueError(
            "attach_scalar_head: the model ties its output layer to the embedding "
            "(share_embeddings_and_output_weights=True); build it with "
            "share_embeddings_and_output_weights=False (--untie-embeddings-and-output-weights)"
        )
    config = model.config
    model.output_layer = ScalarHead(
        config.hidden_size, config.sequence_parallel, config.params_dtype
    )
    return model
