"""``ReferenceCoreAttention``: megatron core attention backed by the pure-torch THD/CP reference.

Megatron's local ``DotProductAttention`` rejects context parallelism (at construction) and packed
THD input (at forward), and Transformer Engine does not run on CPU. This module has the
constructor of ``DotProductAttention`` and computes causal attention for packed THD micro-batches
over the micro-batch's CP group (``packed_seq_params.cp_group``, else the static CP group), so the
local layer spec runs every (D)CP layout on CPU and serves as the numerical oracle.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.runtime.attention import causal_attention, group_size, thd_attention

import_megatron_core()

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


class ReferenceCoreAttention(MegatronModule):
    """Causal core attention for sbhd and packed THD input, with static or per-micro-batch CP.

    Input ``query`` ``[s, b, h, d]`` (sbhd) or ``[t, h, d]`` (THD, megatron squeezes the batch
    dimension); ``key`` / ``value`` with ``num_query_groups`` heads (GQA); V may have another
    head dimension than Q and K (multi-latent attention). Output ``[s, b, h*d_v]`` or
    ``[t, h*d_v]``, like ``DotProductAttention``. No dropout, no attention bias, no sliding window.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ) -> None:
        super().__init__(config=config)
        _check_supported(config, attn_mask_type, attention_dropout)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        # Layer scaling divides the scores by layer_number and the softmax multiplies it back:
        # the net scale is the plain one. MLA passes its own scale and head dimensions (Q/K:
        # k_channels, V: v_channels); the computation takes them from the tensors it is given.
        head_dim = k_channels if k_channels is not None else config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """Causal attention; ``attention_mask`` is ignored (as megatron's causal softmax does)."""
        if attention_bias is not None:
            raise ValueError("ReferenceCoreAttention does not support attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        return self._unpacked(query, key, value)

    def _static_cp_group(self) -> Optional[dist.ProcessGroup]:
        return getattr(self.pg_collection, "cp", None)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        group = params.cp_group if params.cp_group is not None else self._static_cp_group()
        if params.local_cp_size == 1:
            group = None  # DCP: a micro-batch on a group of one needs no communication
        cu_padded = params.cu_seqlens_q_padded
        if cu_padded is None:
            cu_padded = params.cu_seqlens_q
        return thd_attention(
            query, key, value, cu_padded, params.cu_seqlens_q, group, self.softmax_scale
        )

    def _unpacked(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """sbhd: without CP plain causal attention; with static CP each batch row is one sequence
        in megatron's zigzag layout (``get_batch_on_this_cp_rank``)."""
        group = self._static_cp_group()
        cp_size = group_size(group)
        if cp_size == 1:
            return causal_attention(query, key, value, self.softmax_scale)
        seqlen = query.shape[0] * cp_size
        cu_padded = torch.tensor([0, seqlen], dtype=torch.int32)
        rows = [
            thd_attention(q, k, v, cu_padded, None, group, self.softmax_scale)
            for q, k, v in zip(query.unbind(1), key.unbind(1), value.unbind(1))
        ]
        return torch.stack(rows, dim=1)


def _check_supported(
    config: TransformerConfig, attn_mask_type: AttnMaskType, attention_dropout: Optional[float]
) -> None:
    """ValueErrors naming the setting ReferenceCoreAttention cannot honour."""
    check_reference_attention(config, attention_dropout)
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(
            f"ReferenceCoreAttention is causal only, got attn_mask_type={attn_mask_type}"
        )


def check_reference_attention(
    config: TransformerConfig, attention_dropout: Optional[float] = None
) -> None:
    """ValueErrors, naming the flag and its value, for the settings of ``config`` the reference
    attention does not compute (the entry points check them at start-up)."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(
            f"--attention-dropout {dropout}: ReferenceCoreAttention has no attention dropout; "
            "set --attention-dropout 0 (TransformerConfig.attention_dropout=0.0)"
        )
    if config.softmax_type != "vanilla":
        raise ValueError(
            f"--softmax-type {config.softmax_type}: ReferenceCoreAttention computes the vanilla "
            "softmax only; drop --softmax-type (vanilla)"
        )
    if config.window_size is not None:
        raise ValueError(
            f"--window-size {config.window_size}: ReferenceCoreAttention has no sliding window "
            "(it attends to every earlier token); drop --window-size"
        )


def with_core_attention(spec: Any, core_attention: type = ReferenceCoreAttention) -> Any:
    """A copy of a layer / block / MTP spec (``ModuleSpec``, ``TransformerBlockSubmodules``,
    ``MultiTokenPredictionBlockSubmodules``, ...) with every ``core_attention`` submodule replaced
    by ``core_attention``; the input spec is not modified."""
    return _replace_core_attention(copy.deepcopy(spec), core_attention)


def _replace_core_attention(node: Any, core_attention: type) -> Any:
    if isinstance(node, (list, tuple)):
        return type(node)(_replace_core_attention(item, core_attention) for item in node)
    if isinstance(node, ModuleSpec):
        node.submodules = _replace_core_attention(node.submodules, core_attention)
        return node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if field.name == "core_attention":
                setattr(node, field.name, core_attention)
            else:
                setattr(node, field.name, _replace_core_attention(value, core_attention))
    return node


def reference_layer_spec(**local_spec_kwargs: Any) -> ModuleSpec:
    """``get_gpt_layer_local_spec(**local_spec_kwargs)`` with ``ReferenceCoreAttention``."""
    return with_core_attention(get_gpt_layer_local_spec(**local_spec_kwargs))
