"""What ``megatron_dcp.pretrain_vlm`` adds to the entry points' shared start-up and run
(``integration.training.entry``): the vision flags, their start-up refusals, the model built
from them (megatron-core's LLaVA with the DCP forward: a CLIP ViT, an MLP projector, a GPT), its
tiles' :class:`~megatron_dcp.integration.vision_batches.VisionSpec` and the dataset provider of
vision-language samples. See docs/vlm.md, "Training".

Nothing here imports megatron.training at import time beyond what ``entry`` imports: the entry
point enables the CPU backend first.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from megatron_dcp.integration.data.chat import chat_tokenizer, check_tokenizer_type
from megatron_dcp.integration.data.vlm_datasets import (
    add_vlm_data_args,
    build_vlm_datasets,
    check_vlm_data_args,
    vlm_config_from_args,
)
from megatron_dcp.integration.data.vlm_samples import encoder_patches, image_seq_length
from megatron_dcp.integration.vision_batches import VisionSpec

ENTRY = "pretrain_vlm"
VISION_TYPE_FLAG = "--vision-model-type"
CLIP = "clip"
# Vision encoders of megatron's LLaVA that pretrain_vlm does not build, and why.
REFUSED_VISION_TYPES = {
    "siglip": "SigLIP has no class token and megatron's LLaVA pairs it with pixel shuffle",
    "radio": "RADIO runs dynamic resolution and its own position-embedding interpolation",
    "internvit": "InternViT needs pixel shuffle and its own layer spec",
}
# LLaVA's position embeddings under DCP: RoPE (or none) on the combined positions.
POSITION_TYPES = ("rope", "none")
CLASS_TOKEN_LEN = 1  # a CLIP ViT's class token


def add_vision_args(parser: argparse.ArgumentParser) -> None:
    """The vision encoder's flags and the vision-language data flags (megatron's ``--img-h``,
    ``--img-w``, ``--patch-dim`` and ``--num-channels`` give the tile); RoPE by default (the
    only learned position LLaVA cannot give an image's tokens)."""
    group = parser.add_argument_group(title="vision-language model (megatron_dcp.pretrain_vlm)")
    group.add_argument(
        VISION_TYPE_FLAG,
        default=CLIP,
        metavar="TYPE",
        help="The vision encoder: clip (a CLIP ViT; the only one built here).",
    )
    group.add_argument(
        "--vision-num-layers", type=int, default=24, help="Layers of the vision encoder."
    )
    group.add_argument(
        "--vision-hidden-size", type=int, default=1024, help="Width of the vision encoder."
    )
    group.add_argument(
        "--vision-num-attention-heads",
        type=int,
        default=16,
        help="Attention heads of the vision encoder.",
    )
    group.add_argument(
        "--vision-ffn-hidden-size",
        type=int,
        default=None,
        help="MLP size of the vision encoder (default: 4 × --vision-hidden-size).",
    )
    group.add_argument(
        "--vision-projection-ffn-hidden-size",
        type=int,
        default=None,
        help="Hidden size of the MLP projector from the vision encoder to the language model "
        "(default: the language model's --ffn-hidden-size).",
    )
    group.add_argument(
        "--disable-vision-class-token",
        action="store_true",
        help="Drop the encoder's class token before the projector (megatron's multimodal "
        "examples' flag): a tile gives the language model its patches only.",
    )
    add_vlm_data_args(group)
    parser.set_defaults(position_embedding_type="rope")


def vision_spec(args: argparse.Namespace) -> VisionSpec:
    """What the model makes of a tile: ``(C, H, W)``, its language-model tokens (the patches,
    plus the class token unless ``--disable-vision-class-token``) and its encoder patches."""
    drop = bool(args.disable_vision_class_token)
    tokens = image_seq_length(args.img_h, args.img_w, args.patch_dim, CLASS_TOKEN_LEN, drop)
    patches = encoder_patches(args.img_h, args.img_w, args.patch_dim, CLASS_TOKEN_LEN)
    return VisionSpec((args.num_channels, args.img_h, args.img_w), tokens, patches)


def check_vision_args(args: argparse.Namespace) -> None:
    """The vision-language settings pretrain_vlm refuses at start-up (ValueErrors naming flag,
    value and fix), then the data flags (``check_vlm_data_args``)."""
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"--pipeline-model-parallel-size={args.pipeline_model_parallel_size}: megatron_dcp."
            f"{ENTRY} does not run LLaVA's encoder and decoder pipeline stages under DCP yet; "
            "give --pipeline-model-parallel-size 1 (use tensor or data parallelism)."
        )
    if args.position_embedding_type not in POSITION_TYPES:
        raise ValueError(
            f"--position-embedding-type={args.position_embedding_type}: LLaVA counts an image "
            "as one learned position, not its tokens' positions; give --position-embedding-type "
            "rope (the default here) or none."
        )
    check_vision_type(args.vision_model_type)
    check_vision_shape(args)
    if getattr(args, "vlm_data", None):
        check_tokenizer_type(args.tokenizer_type)
    check_vlm_data_args(args, vision_spec(args).tokens_per_tile)


def check_vision_type(vision_type: str) -> None:
    if vision_type == CLIP:
        return
    reason = REFUSED_VISION_TYPES.get(vision_type)
    known = f"{reason}, which DCP's vision path does not run" if reason else "not a known encoder"
    raise ValueError(
        f"{VISION_TYPE_FLAG}={vision_type}: {known}; give {VISION_TYPE_FLAG} {CLIP} (a CLIP ViT)."
    )


def check_vision_shape(args: argparse.Namespace) -> None:
    """Tiles made of whole patches, and vision heads that divide the vision width."""
    for flag, size in (("--img-h", args.img_h), ("--img-w", args.img_w)):
        if args.patch_dim < 1 or size % args.patch_dim:
            raise ValueError(
                f"{flag}={size} with --patch-dim={args.patch_dim}: the CLIP ViT cuts a tile into "
                "whole patches; give an image size that is a multiple of --patch-dim."
            )
    if args.vision_hidden_size % args.vision_num_attention_heads:
        raise ValueError(
            f"--vision-hidden-size={args.vision_hidden_size} with --vision-num-attention-heads="
            f"{args.vision_num_attention_heads}: the heads must divide the width; change either."
        )


@dataclass
class VLMModelConfig:
    """The model pretrain_vlm builds: the language model's megatron ``GPTModelConfig``
    (``language``), the vision encoder's and projector's TransformerConfigs, the tiles, and
    whether megatron's local modules (CPU, ``--transformer-impl local``) build it."""

    language: Any
    vision: Any
    projection: Any
    spec: VisionSpec
    patch_dim: int
    drop_class_token: bool
    local: bool

    @property
    def transformer(self) -> Any:
        """The language model's TransformerConfig (what DCP's model checks read)."""
        return self.language.transformer


def vision_config(language: Any, args: argparse.Namespace) -> Any:
    """The CLIP ViT's TransformerConfig: the language model's with the vision dims, no CP and no
    sequence parallelism (each CP rank encodes whole tiles)."""
    config = copy.deepcopy(language)
    heads = args.vision_num_attention_heads
    config.num_layers = args.vision_num_layers
    config.hidden_size = args.vision_hidden_size
    config.num_attention_heads = heads
    config.num_query_groups = heads
    config.kv_channels = args.vision_hidden_size // heads
    config.ffn_hidden_size = args.vision_ffn_hidden_size or 4 * args.vision_hidden_size
    config.context_parallel_size = 1
    config.sequence_parallel = False
    config.vision_model_type = args.vision_model_type
    return config


def projection_config(language: Any, args: argparse.Namespace) -> Any:
    """The MLP projector's TransformerConfig: the language model's, its own MLP size."""
    config = copy.deepcopy(language)
    config.ffn_hidden_size = args.vision_projection_ffn_hidden_size or language.ffn_hidden_size
    config.context_parallel_size = 1
    config.sequence_parallel = False
    return config


def vlm_model_config(args: argparse.Namespace, language: Any, local: bool) -> VLMModelConfig:
    """The :class:`VLMModelConfig` of ``args``, its language part ``language`` (a
    ``GPTModelConfig``, built as pretrain_gpt builds it)."""
    transformer = language.transformer
    return VLMModelConfig(
        language=language,
        vision=vision_config(transformer, args),
        projection=projection_config(transformer, args),
        spec=vision_spec(args),
        patch_dim=args.patch_dim,
        drop_class_token=bool(args.disable_vision_class_token),
        local=local,
    )


def vlm_datasets_provider(tokens_per_tile: int) -> Callable[..., Any]:
    """megatron's dataset provider of vision-language samples, ``tokens_per_tile`` image tokens a
    tile (``--vlm-data`` with the tokenizer's chat template, else mock samples)."""

    def provide(num_samples: List[int], vp_stage: Optional[int] = None) -> Any:
        from megatron.training import get_args, get_tokenizer

        args = get_args()
        chat = chat_tokenizer(get_tokenizer(), args.tokenizer_type) if args.vlm_data else None
        return build_vlm_datasets(vlm_config_from_args(args, tokens_per_tile, num_samples), chat)

    provide.is_distributed = True  # every rank feeds the DCP wrapper
    return provide


def build_vlm_model(
    config: VLMModelConfig,
    vocab_size: int,
    pre_process: bool = True,
    post_process: bool = True,
    pg_collection: Any = None,
    vp_stage: Optional[int] = None,
) -> Any:
    """This rank's :class:`~megatron_dcp.integration.vlm_model.DCPLLaVAModel` of ``config``: the
    local modules (the reference attention for the language model, megatron's local ViT, local
    linears in the projector) when ``config.local``, else Transformer Engine's."""
    from megatron.core.enums import ModelType

    from megatron_dcp.integration.vlm_model import DCPLLaVAModel

    language = config.language
    vision_layer, projector = vision_specs(config.local)
    model = DCPLLaVAModel(
        language_transformer_config=language.transformer,
        language_transformer_layer_spec=language_spec(config, vp_stage),
        language_vocab_size=vocab_size,
        language_max_sequence_length=language.seq_length,
        vision_transformer_config=config.vision,
        vision_transformer_layer_spec=vision_layer,
        drop_vision_class_token=config.drop_class_token,
        vision_projection_config=config.projection,
        vision_projection_layer_spec=projector,
        parallel_output=True,
        share_embeddings_and_output_weights=language.share_embeddings_and_output_weights,
        language_position_embedding_type=language.position_embedding_type,
        language_rotary_percent=language.rotary_percent,
        language_rotary_base=language.rotary_base,
        language_rope_scaling=language.rope_scaling,
        language_rope_scaling_factor=language.rope_scaling_factor,
        pre_process=pre_process,
        post_process=post_process,
        img_h=config.spec.tile_shape[1],
        img_w=config.spec.tile_shape[2],
        patch_dim=config.patch_dim,
        fp16_lm_cross_entropy=language.fp16_lm_cross_entropy,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    model.model_type = ModelType.encoder_or_decoder  # as megatron.training's get_model sets it
    return model


def language_spec(config: VLMModelConfig, vp_stage: Optional[int]) -> Any:
    """The language model's layer spec: the CPU backend's local spec (reference attention), or
    megatron's default (Transformer Engine) as pretrain_gpt takes it."""
    if config.local:
        from megatron_dcp.integration.cpu.gpt_layer_spec import local_transformer_spec

        return local_transformer_spec(config.language.transformer, vp_stage)
    from megatron.training.models.gpt import default_layer_spec

    return default_layer_spec(config.language, vp_stage)


def vision_specs(local: bool) -> tuple:
    """The ViT layer spec and the projector's MLP submodules: megatron's local modules, or
    Transformer Engine's."""
    from megatron.core.models.vision import vit_layer_specs
    from megatron.core.transformer.mlp import MLPSubmodules

    if local:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        layer = vit_layer_specs.get_vit_layer_with_local_spec()
        return layer, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TERowParallelLinear,
    )

    layer = vit_layer_specs.get_vit_layer_with_transformer_engine_spec()
    return layer, MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)


def describe_parts(model: Any) -> str:
    """One log line: the classes of the model's parts and their parameters on this rank."""
    names = ("vision_model", "vision_projection", "language_model")
    counts = [sum(p.numel() for p in getattr(model, name).parameters()) for name in names]
    parts = ", ".join(
        f"{label} {cls} ({count} parameters)"
        for label, cls, count in zip(("vision encoder", "projector", "language model"),
                                     parts_of(model), counts)  # fmt: skip
    )
    return f"VLM model: {parts}"


def parts_of(model: Any) -> Sequence[str]:
    """The classes of LLaVA's vision encoder, projector and language model, as built."""
    names = ("vision_model", "vision_projection", "language_model")
    return tuple(type(getattr(model, name)).__name__ for name in names)
