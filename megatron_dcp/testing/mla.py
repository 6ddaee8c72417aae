"""The tiny multi-latent-attention (MLA) model of the oracle tests: ``TinyGPTOptions`` with
``multi_latent_attention`` builds megatron's ``MLATransformerConfig`` and the CPU backend's local
spec (``integration.cpu.gpt_layer_spec``: ``MLASelfAttention`` with the reference attention),
shaped like DeepSeek-V3 at toy size.

The head dimensions differ on purpose: Q and K have ``qk_head_dim + qk_pos_emb_head_dim`` = 24
channels, V has 12, so the THD value padding (V padded to 24 channels and trimmed again) runs.
YaRN RoPE with a scaling factor and ``mscale_all_dim`` makes the softmax scale MLA's own
(``mscale² / √24``, not ``1 / √24``); ``original_max_position_embeddings`` 64 puts the test
lengths (up to 200) in the range YaRN rescales.
"""

from __future__ import annotations

from typing import Any

MLA_FIELDS = dict(
    kv_lora_rank=32,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=64,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def mla_fields(options: Any) -> dict:
    """``MLATransformerConfig``'s fields of the options (none without MLA)."""
    if not options.multi_latent_attention:
        return {}
    # DeepSeek-V3 normalises the compressed query and key/value (--qk-layernorm); without a
    # query compression megatron's local spec has no query norm to build (spec_refusals).
    low_rank_query = options.q_lora_rank is not None
    return {
        **MLA_FIELDS,
        "multi_latent_attention": True,
        "q_lora_rank": options.q_lora_rank,
        "qk_layernorm": low_rank_query,
    }


def config_class(options: Any) -> type:
    """``MLATransformerConfig`` for an MLA model, else ``TransformerConfig``."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    return MLATransformerConfig if options.multi_latent_attention else TransformerConfig
