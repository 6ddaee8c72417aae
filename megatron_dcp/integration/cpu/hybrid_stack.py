"""The hybrid (Mamba + attention + MLP) layer stack without Transformer Engine.

megatron-core 0.19.2's ``hybrid_stack_spec`` is built from Transformer Engine modules only
(norms fused into the input projections, ``TEDotProductAttention``). On the CPU backend the
same stack is built from megatron's local modules instead, with the reference THD/CP attention:

- ``M`` (Mamba): ``MambaLayer`` with a separate input norm, ``MambaMixer`` with local column /
  row parallel projections (its SSM and conv kernels: ``integration.cpu.mamba_kernels``);
- ``*`` (attention): ``TransformerLayer`` with the input norm, self-attention of the local GPT
  spec and ``ReferenceCoreAttention``, no MLP;
- ``-`` (MLP): ``MLPLayer`` with the pre-MLP norm and the local GPT spec's MLP.

The parameters are those of the TE stack, with each fused norm weight held by the layer's own
norm module instead (different names in a checkpoint, the same computation).

Mamba's context-parallel all-to-alls undo and redo the zigzag layout of packed (THD) sequences
with Transformer Engine's ``thd_get_partitioned_indices``; :data:`THD_INDICES` computes the same
indices from the runtime's zigzag layout.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from megatron_dcp.integration.cpu.core_attention import reference_layer_spec
from megatron_dcp.runtime.packing import local_token_indices


def reference_hybrid_stack_spec() -> Any:
    """``HybridStack``'s spec from local modules and the reference attention (module docstring)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    gpt = reference_layer_spec().submodules
    mixer = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    mamba = MambaLayerSubmodules(
        norm=gpt.input_layernorm, mixer=mixer, mamba_bda=get_bias_dropout_add
    )
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm,
        self_attention=gpt.self_attention,
        self_attn_bda=gpt.self_attn_bda,
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(module=MambaLayer, submodules=mamba),
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
        ),
    )


def local_norm(config: Any, hidden_size: int, eps: float = 1e-5) -> Any:
    """``HybridStack``'s final norm without Transformer Engine: megatron's local norm of the
    configured type (``TENorm``'s signature)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps)


def thd_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Transformer Engine's ``thd_get_partitioned_indices``: the positions, in the packed
    sequences bounded by ``cu_seqlens`` (padded to 2·cp_size), of ``cp_rank``'s zigzag share."""
    indices = local_token_indices(cu_seqlens.cpu(), cp_size, cp_rank)
    if int(cu_seqlens[-1]) != total_tokens:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, not at {total_tokens} tokens")
    return indices.to(device=cu_seqlens.device, dtype=torch.int32)


# What ``mamba_context_parallel`` calls of ``transformer_engine_torch`` (``tex``).
THD_INDICES = SimpleNamespace(thd_get_partitioned_indices=thd_partitioned_indices)
