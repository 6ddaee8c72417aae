"""The hybrid (Mamba + attention + MLP) layer stack without Transformer Engine.

megatron-core 0.19.2's ``hybrid_stack_spec`` is built from Transformer Engine modules only
(norms fused into the input projections, ``TEDotProductAttention``). On the CPU backend the
same stack is built from megatron's local modules instead, with the reference THD/CP attention:

- ``M`` (Mamba): ``MambaLayer`` with a separate input norm, ``MambaMixer`` with local column /
  row parallel projections (its SSM and conv kernels: ``integration.cpu.mamba_kernels``);
- ``*`` (attention): ``TransformerLayer`` with the input norm, self-attention of the local GPT
  spec and ``ReferenceCoreAttention``, no MLP;
- ``-`` (MLP): ``MLPLayer`` with the pre-MLP norm and the local GPT spec's MLP;
- ``E`` (MoE): ``MoETransformerLayer`` with the pre-MLP norm and megatron's local MoE spec
  (sequential experts, ``SequentialMLP``; the TE stack's are grouped, the same parameters).

The attention layers follow the config as the TE stack's do: ``--qk-layernorm`` builds q/k norms
of the ``--normalization`` type, ``--qk-l2-norm`` L2 norms. The parameters are those of the TE
stack, with each fused norm weight held by the layer's own norm module instead (different names
in a checkpoint, the same computation). Layers it has no module for (``G``, ``D``, ``+``, MTP)
are refused at start-up (``spec_refusals.check_local_hybrid_spec``).

Mamba's context-parallel all-to-alls undo and redo the zigzag layout of packed (THD) sequences
with Transformer Engine's ``thd_get_partitioned_indices``; :data:`THD_INDICES` computes the same
indices from the runtime's zigzag layout.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from megatron_dcp.integration.cpu.core_attention import reference_layer_spec
from megatron_dcp.runtime.packing import local_token_indices


def reference_hybrid_stack_spec(config: Optional[Any] = None) -> Any:
    """``HybridStack``'s spec from local modules and the reference attention (module docstring),
    its attention layers' q/k norms as ``config`` (a ``TransformerConfig``; None: none) asks."""
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

    gpt = reference_layer_spec(**_attention_options(config)).submodules
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
            moe_layer=_moe_layer(gpt.pre_mlp_layernorm),
        ),
    )


def _attention_options(config: Optional[Any]) -> dict:
    """``get_gpt_layer_local_spec``'s q/k norm options of ``config``."""
    if config is None:
        return {}
    return dict(
        qk_layernorm=config.qk_layernorm,
        qk_l2_norm=config.qk_l2_norm,
        normalization=config.normalization,
    )


def _moe_layer(norm: Any) -> Any:
    """The ``E`` layer: the pre-MLP norm and megatron's local MoE (sequential experts)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayerSubmodules,
    )

    # The spec does not depend on the number of experts (the config's is built).
    moe = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)
    submodules = TransformerLayerSubmodules(
        pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add
    )
    return ModuleSpec(module=MoETransformerLayer, submodules=submodules)


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
