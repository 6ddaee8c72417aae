"""The names a rank's parameters have in the single-process model ``megatron-dcp check``'s
reference arm builds: pipeline stages renumber their layers from 0 (megatron's ``layer_number``
is global), the last stage of a model with tied embeddings holds its own copy of the word
embeddings as ``output_layer.weight``, and Transformer Engine's spec fuses each layer norm into
the linear layer after it (``linear_qkv.layer_norm_weight`` is the local spec's
``input_layernorm.weight``)."""

from __future__ import annotations

import re
from typing import Dict, Iterator, Tuple

import torch

LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")
TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
FUSED_NORMS = {  # Transformer Engine's name -> the local spec's
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".self_attention.linear_qkv.layer_norm_bias": ".input_layernorm.bias",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_bias": ".pre_mlp_layernorm.bias",
}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron's DDP and Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def renumbered(model: torch.nn.Module, local: str) -> str:
    """``local`` with its decoder layer's index made global (a stage's layers count from 0;
    their ``layer_number`` is the whole model's, from 1)."""
    match = LAYER_NAME.match(local)
    if not match:
        return local
    layer = model.decoder.layers[int(match.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{local[match.end():]}"


def global_name(model: torch.nn.Module, local: str) -> str:
    """The single-process name of parameter ``local`` of the (unwrapped) model chunk ``model``."""
    name = renumbered(model, local)
    if name == TIED_OUTPUT and model.share_embeddings_and_output_weights:
        return WORD_EMBEDDINGS  # the last stage's copy (its gradient is summed with the first's)
    for fused, plain in FUSED_NORMS.items():
        if name.endswith(fused):
            return name[: -len(fused)] + plain
    return name


def named_parameters(chunks: list) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """Every parameter of this rank's model chunks by its single-process name."""
    for chunk in chunks:
        model = unwrap(chunk)
        for local, param in model.named_parameters():
            yield global_name(model, local), param


def parameter_gradient(param: torch.nn.Parameter) -> torch.Tensor:
    """megatron's gradient of ``param`` after its finalisation (``main_grad`` under DDP)."""
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    return torch.zeros_like(param) if grad is None else grad


def by_global_name(chunks: list, gradients: bool) -> Dict[str, torch.Tensor]:
    """This rank's weights (or gradients) as float32 CPU copies, by single-process name."""
    found = {}
    for name, param in named_parameters(chunks):
        tensor = parameter_gradient(param) if gradients else param
        found[name] = tensor.detach().float().cpu().clone()
    return found
