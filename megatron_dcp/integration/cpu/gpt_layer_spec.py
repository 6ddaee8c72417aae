"""The GPT layer spec of the CPU backend (and of ``--transformer-impl local``): megatron's local
modules, with ``ReferenceCoreAttention`` as the core attention, following the model config as
megatron's ``default_layer_spec`` does.

Built from megatron-core 0.19.2's own local spec functions, then :func:`with_core_attention`:

- dense layers: ``get_gpt_layer_local_spec`` with ``--qk-layernorm`` (q/k norms of the
  ``--normalization`` type), ``--qk-l2-norm`` (``L2Norm``; megatron's ``default_layer_spec``
  drops it for local dense layers, its MoE and Transformer Engine specs build it) and
  ``--normalization``;
- ``--num-experts``: ``get_gpt_decoder_block_spec`` (MoE layers every ``--moe-layer-freq``,
  dense layers between them; sequential experts, ``SequentialMLP``; shared experts with
  ``--moe-shared-expert-intermediate-size``);
- ``--heterogeneous-layers-config-path``: ``get_gpt_heterogeneous_layer_spec`` (per-layer
  attention and MLP: no-op, linear replacement, own query groups or FFN size);
- ``--mtp-num-layers``: megatron's ``mtp_block_spec`` builds the MTP layers from the same config
  (the CPU backend's patch gives them the reference attention);
- ``--experimental-attention-variant gated_delta_net``: Gated DeltaNet layers every
  ``--linear-attention-freq``, dense or MoE MLPs (``gdn_layer_spec``).

Everything else the config asks for is refused at start-up (``spec_refusals``); the spec
function checks again, for callers that skip the entry point's start-up.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_dcp.integration.cpu.core_attention import with_core_attention
from megatron_dcp.integration.cpu.gdn_layer_spec import GDN_VARIANT, local_gdn_block_spec
from megatron_dcp.integration.cpu.spec_refusals import check_buildable, check_heterogeneous
from megatron_dcp.integration.megatron_import import import_megatron_core

import_megatron_core()

from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (  # noqa: E402
    get_gpt_heterogeneous_layer_spec,
)
from megatron.core.transformer.heterogeneous.heterogeneous_config import (  # noqa: E402
    HeterogeneousTransformerConfig,
)


def local_gpt_layer_spec(model_config: Any, vp_stage: Optional[int] = None) -> Any:
    """The layer (or block) spec of ``model_config`` (megatron's ``GPTModelConfig``) from local
    modules and the reference core attention; ``vp_stage`` as for ``default_layer_spec``."""
    return local_transformer_spec(model_config.transformer, vp_stage)


def local_transformer_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
    """:func:`local_gpt_layer_spec` of a ``TransformerConfig``."""
    check_buildable(config)
    if config.experimental_attention_variant == GDN_VARIANT:
        spec = local_gdn_block_spec(config, vp_stage)
    elif config.num_moe_experts is not None:
        spec = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
            vp_stage=vp_stage,
        )
    elif isinstance(config, HeterogeneousTransformerConfig):
        check_heterogeneous(config)
        spec = get_gpt_heterogeneous_layer_spec(config, use_te=False, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
        )
    return with_core_attention(spec)
