"""A tiny vision-language model (megatron-core's LLaVA: CLIP ViT, MLP projector, GPT) for the
oracle tests, its samples, and its single-process oracle.

The DCP side builds :class:`~megatron_dcp.integration.vlm_model.DCPLLaVAModel` (LLaVA with the
DCP forward) in any TP × CP layout; the oracle builds the same weights (a function of each
parameter's name and the seed, ``testing.gpt.init_from_global_names``) in one process, without
parallelism, and runs every sample alone through LLaVA's *own* forward: its ``_preprocess_data``
widens the placeholders, so the oracle shares neither the combined-coordinate mapping
(``integration.data.vlm_samples``) nor the encoder split, the gather or the packing with what it
checks. No dropout anywhere: equality of runs needs it off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, List, Optional, Sequence, Tuple

import torch

from megatron_dcp.integration.cpu.core_attention import reference_layer_spec
from megatron_dcp.integration.data.vlm_samples import (
    IMAGE_TOKEN,
    image_seq_length,
    make_vlm_sample,
)
from megatron_dcp.integration.training.vlm_entry import projection_config, vision_config
from megatron_dcp.integration.vision_batches import VisionSpec
from megatron_dcp.integration.vlm_model import DCPLLaVAModel
from megatron_dcp.testing.gpt import (
    ReferenceResult,
    TinyGPTOptions,
    exact_run,
    gather_full_tensors,
    init_from_global_names,
    init_megatron,
    tiny_gpt_config,
    to_float64,
)
from megatron_dcp.tools.launching.local_ranks import run_distributed

Sample = dict


@dataclass(frozen=True)
class TinyVLMOptions:
    """The language model's shape (``language``) and the vision encoder's: tiles of
    ``channels × img × img`` pixels cut into ``patch``-pixel patches (plus a class token, dropped
    before the projector, as LLaVA's CLIP does)."""

    language: TinyGPTOptions = TinyGPTOptions(num_layers=2, hidden_size=32, ffn_hidden_size=64)
    img: int = 16
    patch: int = 8
    channels: int = 3
    vision_layers: int = 1
    vision_hidden: int = 16
    vision_heads: int = 2
    vision_ffn: int = 32
    projector_ffn: int = 32

    @property
    def tokens_per_tile(self) -> int:
        return image_seq_length(self.img, self.img, self.patch)

    @property
    def spec(self) -> VisionSpec:
        patches = (self.img // self.patch) ** 2 + 1
        return VisionSpec((self.channels, self.img, self.img), self.tokens_per_tile, patches)


def _vision_flags(options: TinyVLMOptions) -> SimpleNamespace:
    """The encoder and projector sizes as pretrain_vlm's flags, for its config builders."""
    return SimpleNamespace(
        vision_num_layers=options.vision_layers,
        vision_hidden_size=options.vision_hidden,
        vision_num_attention_heads=options.vision_heads,
        vision_ffn_hidden_size=options.vision_ffn,
        vision_projection_ffn_hidden_size=options.projector_ffn,
        vision_model_type="clip",
    )


def build_tiny_vlm(
    tp: int = 1, cp: int = 1, options: Optional[TinyVLMOptions] = None
) -> DCPLLaVAModel:
    """This rank's tiny LLaVA (after ``init_megatron`` with the same layout), its weights those
    of every layout."""
    from megatron.core.enums import ModelType
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    options = options or TinyVLMOptions()
    language = tiny_gpt_config(tp, 1, cp, None, options.language)
    flags = _vision_flags(options)
    model = DCPLLaVAModel(
        language_transformer_config=language,
        language_transformer_layer_spec=reference_layer_spec(),
        language_vocab_size=options.language.vocab_size,
        language_max_sequence_length=options.language.max_sequence_length,
        vision_transformer_config=vision_config(language, flags),
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=True,
        vision_projection_config=projection_config(language, flags),
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        language_position_embedding_type="rope",
        img_h=options.img,
        img_w=options.img,
        patch_dim=options.patch,
    )
    model.model_type = ModelType.encoder_or_decoder  # as megatron.training's get_model sets it
    init_from_global_names(model, options.language.seed)
    return model


def vlm_samples(
    texts: Sequence[int], images: Sequence[Sequence[int]], options: TinyVLMOptions, seed: int = 0
) -> List[Sample]:
    """Samples of ``texts[i]`` text tokens and images of ``images[i]`` tiles each (placeholders
    spread over the text, the first at the start when there are several); random tokens and
    pixels, the first quarter of each text outside the loss."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for text, tiles in zip(texts, images):
        samples.append(_vlm_sample(text, list(tiles), options, generator))
    return samples


def _vlm_sample(
    text: int, tiles: List[int], options: TinyVLMOptions, generator: torch.Generator
) -> Sample:
    vocab = options.language.vocab_size
    sequence = torch.randint(1, vocab, (text + 1,), generator=generator)
    places = _placeholders(text, len(tiles))
    sequence[places] = IMAGE_TOKEN
    tokens, labels = sequence[:-1].clone(), sequence[1:].clone()
    loss_mask = (labels != IMAGE_TOKEN).float()
    loss_mask[: text // 4] = 0.0
    pixels = torch.randn(sum(tiles), options.channels, options.img, options.img, generator=generator)
    sample = make_vlm_sample(tokens, labels, loss_mask, pixels, tiles, options.tokens_per_tile)
    return with_text(sample, (tokens, labels, loss_mask), tiles)


def _placeholders(text: int, count: int) -> List[int]:
    """Where ``count`` placeholders go in a text of ``text`` tokens: evenly spread, the first at
    the start when there are several (LLaVA's common layout), two adjacent when they crowd."""
    if count == 0:
        return []
    if count == 1:
        return [text // 2]
    step = max(1, (text - 1) // count)
    return [min(index * step, text - 1 - (count - 1 - index)) for index in range(count)]


def llava_inputs(sample: Sample) -> Tuple[torch.Tensor, ...]:
    """A combined-coordinate sample back in LLaVA's own inputs: text tokens with one placeholder
    per image, text labels and mask, the tiles and the tiles of each image (``text_*`` keys
    kept by :func:`vlm_samples`)."""
    return (
        sample["text_tokens"],
        sample["text_labels"],
        sample["text_loss_mask"],
        sample["images"],
        sample["image_tiles"],
    )


def with_text(sample: Sample, text: Tuple[torch.Tensor, ...], tiles: Sequence[int]) -> Sample:
    """``sample`` carrying its LLaVA inputs for the oracle (the DCP runtime ignores them)."""
    tokens, labels, loss_mask = text
    return {
        **sample,
        "text_tokens": tokens,
        "text_labels": labels,
        "text_loss_mask": loss_mask,
        "image_tiles": torch.tensor(list(tiles), dtype=torch.int64),
    }


def llava_loss_and_backward(model: torch.nn.Module, samples: Sequence[Sample]) -> Tuple[float, int]:
    """The oracle: each sample alone through LLaVA's own forward (batch 1, sbhd, no CP); its
    summed token loss under LLaVA's loss mask, and the token count; gradients accumulated."""
    total, tokens = 0.0, 0
    for sample in samples:
        text, labels, mask, images, tiles = llava_inputs(sample)
        dtype = next(model.parameters()).dtype
        losses, loss_mask = model(
            images=images.to(dtype),
            input_ids=text.view(1, -1),
            position_ids=torch.arange(text.numel()).view(1, -1),
            attention_mask=None,
            labels=labels.view(1, -1),
            loss_mask=mask.view(1, -1),
            num_image_tiles=tiles.to(torch.int),
        )
        loss = (losses * loss_mask).sum()
        loss.backward()
        total += loss.item()
        tokens += int((loss_mask != 0).sum())
    return total, tokens


def _reference_pass(
    samples: Sequence[Sample], options: TinyVLMOptions, float64: bool
) -> Tuple[float, int, dict]:
    model = build_tiny_vlm(options=options)
    model = to_float64(model) if float64 else model
    loss_sum, num_tokens = llava_loss_and_backward(model, samples)
    return loss_sum, num_tokens, gather_full_tensors([model])


def _reference_worker(
    rank: int, world_size: int, samples: Sequence[Sample], options: TinyVLMOptions
) -> ReferenceResult:
    init_megatron(seed=options.language.seed)
    exact_loss, _, exact = _reference_pass(samples, options, float64=True)
    reordered_loss, _, reordered = _reference_pass(samples[::-1], options, float64=False)
    loss_sum, num_tokens, grads = _reference_pass(samples, options, float64=False)
    runs = [(loss_sum, grads), (reordered_loss, reordered)]
    return ReferenceResult(loss_sum, num_tokens, grads, exact_run(exact_loss, exact, runs))


def vlm_reference(samples: Sequence[Sample], options: TinyVLMOptions) -> ReferenceResult:
    """Summed loss, token count and full gradients of the tiny LLaVA on ``samples``: LLaVA's own
    forward, one sample at a time, in a one-rank job (float64 exact values, float32 rounding)."""
    (result,) = run_distributed(_reference_worker, 1, list(samples), options)
    return result


def replace_language(options: TinyVLMOptions, **changes: Any) -> TinyVLMOptions:
    return dataclasses.replace(options, language=dataclasses.replace(options.language, **changes))
