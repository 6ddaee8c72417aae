"""The tiny Gated DeltaNet hybrid of the oracle tests: ``TinyGPTOptions`` with
``linear_attention_freq`` builds a GPT whose layers are Gated DeltaNet layers except every
``linear_attention_freq``-th, which is standard attention (``integration.cpu.gdn_layer_spec``:
local modules, the reference core attention, the reference GDN kernels on CPU)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_dcp.integration.cpu.core_attention import with_core_attention
from megatron_dcp.integration.cpu.gdn_layer_spec import GDN_VARIANT, local_gdn_block_spec

# hidden 64: 4 key heads and 8 value heads of 16 channels (two value heads per key head), so
# every CP size up to 4 and TP 2 × CP 2 split them into whole heads.
GDN_FIELDS = dict(
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_conv_kernel_dim=4,
)


def gdn_fields(options: Any) -> dict:
    """TransformerConfig's Gated DeltaNet fields (none without ``linear_attention_freq``); SiLU
    MLPs without a gated linear unit (whose TP shard the fixtures cannot cut)."""
    if not options.linear_attention_freq:
        return {}
    return dict(
        experimental_attention_variant=GDN_VARIANT,
        linear_attention_freq=options.linear_attention_freq,
        activation_func=torch.nn.functional.silu,  # GDN's convolution asserts SiLU
        **GDN_FIELDS,
    )


def gdn_layer_spec(config: Any, stage: Optional[int]) -> Any:
    """The block spec of the tiny GDN hybrid's chunk ``stage`` (reference core attention)."""
    return with_core_attention(local_gdn_block_spec(config, stage))


def mark_gdn_tp_blocks(model: torch.nn.Module) -> None:
    """Give every GDN layer's block-sharded parameters the ``partition_sizes`` the test
    fixtures shard and gather by (as megatron's Mamba mixer does for its own): ``in_proj``'s
    output is q, k, v, gate, beta and alpha, each split over TP; the convolution's channels are
    q, k and v, each split over TP."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.in_proj.weight.partition_sizes = list(module.in_proj_split_sections)
            qkv = [module.qk_dim_local_tp, module.qk_dim_local_tp, module.v_dim_local_tp]
            module.conv1d.weight.partition_sizes = qkv
