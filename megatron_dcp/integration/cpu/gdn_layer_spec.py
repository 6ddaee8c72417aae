"""The decoder block of a Gated DeltaNet hybrid (``--experimental-attention-variant
gated_delta_net``) from megatron's local modules: the CPU backend's (and ``--transformer-impl
local``'s) counterpart of megatron-core 0.19.2's
``get_transformer_block_with_experimental_attention_variant_spec``, which builds from Transformer
Engine modules only.

The same layers in the same places: a GDN layer wherever ``--linear-attention-freq`` puts one,
standard attention (the reference core attention) in the others, MoE layers every
``--moe-layer-freq`` (sequential experts) and dense MLPs between. A GDN layer is megatron's
``GatedDeltaNet`` with the local counterparts of its Transformer Engine submodules: the input
norm (fused into TE's ``in_proj``) as the layer's own ``input_layernorm`` before a
``ColumnParallelLinear``, the output norm of the ``--normalization`` type, a ``RowParallelLinear``.
The parameters are the same in number and meaning; the kernels are the reference ones on CPU
(``cpu/gdn_kernels.py``) and fla's on a GPU.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional

from megatron_dcp.integration.megatron_import import import_megatron_core

import_megatron_core()

from megatron.core.models.backends import LocalSpecProvider  # noqa: E402
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (  # noqa: E402
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules  # noqa: E402
from megatron.core.tensor_parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
)
from megatron.core.transformer.enums import LayerType  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

GDN_VARIANT = "gated_delta_net"


def local_gdn_module_spec(config: Any) -> ModuleSpec:
    """One ``GatedDeltaNet`` from local modules (module docstring)."""
    norm = LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm")
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear
        ),
        metainfo={"fuse_input_layernorm": False},
    )


def local_gdn_layer_specs(config: Any) -> List[ModuleSpec]:
    """Every decoder layer's spec, in order (before the pipeline split)."""
    kwargs = dict(
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
    )
    dense = get_gpt_layer_local_spec(**kwargs)
    moe = None
    if config.num_moe_experts is not None:
        moe = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, **kwargs)
        moe_pattern = get_moe_layer_pattern(config)
    else:
        moe_pattern = [0] * config.num_layers
    gdn = local_gdn_module_spec(config)
    specs = []
    for linear, expert in zip(get_linear_attention_pattern(config), moe_pattern):
        spec = copy.deepcopy(moe if expert else dense)
        if linear:
            spec.submodules.self_attention = gdn
        specs.append(spec)
    return specs


def local_gdn_block_spec(config: Any, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (``vp_stage``: its virtual stage) and the final norm."""
    specs = local_gdn_layer_specs(config)
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    norm = LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm")
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in ids], layer_norm=norm)
