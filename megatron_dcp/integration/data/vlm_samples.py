"""The item a vision-language dataset yields (:func:`make_vlm_sample`): one sample in *combined
coordinates*, one position per language-model input position, where each image placeholder of
the text has been replaced by its image's tokens (tiles × :func:`image_seq_length` positions).

This is the layout megatron-core's ``LLaVAModel._preprocess_data`` builds inside the model for one
sample (batch 1, no context parallelism). Doing it in the data instead gives the DCP runtime
per-token fields it can pack and slice unchanged; the model only has to put the encoder's outputs
at the image positions, in the order ``vision_slot`` numbers them. For text token j at combined
position ``p_j = j + Σ_{placeholders k before j} (tiles_k · S − 1)``, LLaVA's rule is:

* labels: ``labels[p_j − 1] = text_labels[j − 1]`` for j ≥ 1, and ``labels[L − 1] =
  text_labels[T − 1]``; nothing else (LLaVA's IGNORE_INDEX, written 0 here);
* loss mask: ``loss_mask[p_j] = text_loss_mask[j]``; 0 at every image position and at the text
  position just before a placeholder (text does not predict an image token).

``tests/integration/test_vlm_data.py`` checks this against ``LLaVAModel._preprocess_data`` itself.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_dcp.integration.data.samples import Sample

# megatron's DEFAULT_IMAGE_TOKEN_INDEX: the token id of an image placeholder in the text.
IMAGE_TOKEN = -200
# LLaVA's label for positions outside the loss; written as 0 in the samples (see module doc).
IGNORE_INDEX = -100


def image_seq_length(
    img_h: int, img_w: int, patch_dim: int, class_token_len: int = 1, drop_class_token: bool = True
) -> int:
    """Tokens per tile the language model sees (LLaVA's ``img_seq_len`` for a CLIP-style encoder
    without pixel shuffle or tile tags): the patches, plus the class tokens unless dropped."""
    patches = _patches(img_h, img_w, patch_dim)
    return patches + (0 if drop_class_token else int(class_token_len))


def encoder_patches(img_h: int, img_w: int, patch_dim: int, class_token_len: int = 1) -> int:
    """Tokens per tile the vision encoder runs: the patches and the class tokens."""
    return _patches(img_h, img_w, patch_dim) + int(class_token_len)


def _patches(img_h: int, img_w: int, patch_dim: int) -> int:
    """``(img_h // patch_dim) · (img_w // patch_dim)``, as megatron counts them; ValueError when
    a tile holds no patch."""
    if patch_dim < 1 or img_h < patch_dim or img_w < patch_dim:
        raise ValueError(
            f"--img-h={img_h} --img-w={img_w} --patch-dim={patch_dim}: a tile needs at least one "
            "patch; give a positive --patch-dim no larger than --img-h and --img-w."
        )
    return (img_h // patch_dim) * (img_w // patch_dim)


def combined_length(text_length: int, tiles_per_image: Sequence[int], seq_per_tile: int) -> int:
    """L = T + Σ_k (tiles_k · S − 1): the text's T tokens with each placeholder replaced."""
    return int(text_length) + sum(int(tiles) * seq_per_tile - 1 for tiles in tiles_per_image)


def make_vlm_sample(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    images: torch.Tensor,
    tiles_per_image: Sequence[int],
    image_seq_length: int,
) -> Sample:
    """The combined-coordinates sample of a text sample with image placeholders.

    ``tokens``/``labels``/``loss_mask``: 1-D, length T, in text coordinates (``tokens`` holds
    :data:`IMAGE_TOKEN` at each placeholder, ``labels`` the next token, as LLaVA takes them).
    ``images``: float [Σ tiles, C, H, W], the tiles of each placeholder in order;
    ``tiles_per_image``: the tile count of each placeholder. Returns ``tokens`` (0 at image
    positions), ``labels`` (LLaVA's, 0 where LLaVA ignores a position and wherever a label is
    negative, which LLaVA only leaves under a zero mask), ``loss_mask`` (LLaVA's), ``vision_slot``
    (0 at text positions, 1, 2, … at image positions: slot k + 1 takes the sample's k-th encoder
    output token, tile-major), ``images`` (float32), ``tiles`` and ``length`` (int64 scalars).
    """
    tokens, labels, loss_mask, tiles = _checked(tokens, labels, loss_mask, images, tiles_per_image)
    if image_seq_length < 1:
        raise ValueError(f"image_seq_length={image_seq_length}: needs at least 1 token per tile.")
    placeholder = tokens == IMAGE_TOKEN
    widths = torch.ones_like(tokens)
    widths[placeholder] = tiles * image_seq_length
    ends = torch.cumsum(widths, 0)  # LLaVA's new_position_ids + 1
    length = int(ends[-1])
    text = torch.flatten(torch.nonzero(~placeholder))
    where = ends[text] - 1  # p_j of each text token j
    combined = torch.zeros(length, dtype=torch.int64)
    combined[where] = tokens[text]
    slots = torch.ones(length, dtype=torch.int64)
    slots[where] = 0
    slots[slots == 1] = torch.arange(1, length - text.numel() + 1)
    final_labels = torch.full((length,), IGNORE_INDEX, dtype=torch.int64)
    shifted = text[text >= 1]
    final_labels[ends[shifted] - 2] = labels[shifted - 1]
    final_labels[length - 1] = labels[-1]
    final_labels[final_labels < 0] = 0
    final_mask = torch.zeros(length, dtype=torch.float32)
    final_mask[where] = loss_mask[text].to(torch.float32)
    before = torch.flatten(torch.nonzero(placeholder))
    final_mask[ends[before[before >= 1] - 1] - 1] = 0.0  # the position before each placeholder
    return {
        "tokens": combined,
        "labels": final_labels,
        "loss_mask": final_mask,
        "vision_slot": slots,
        "images": images.to(torch.float32),
        "tiles": torch.tensor(int(tiles.sum()), dtype=torch.int64),
        "length": torch.tensor(length, dtype=torch.int64),
    }


def _checked(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    images: torch.Tensor,
    tiles_per_image: Sequence[int],
) -> tuple:
    """The fields as int64/int64/float tensors and the tiles as an int64 tensor; ValueError when
    they do not describe one sample."""
    fields = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    shapes = {name: tuple(value.shape) for name, value in fields.items()}
    if any(len(shape) != 1 for shape in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"tokens, labels and loss_mask must be 1-D of one length, not {shapes}.")
    if tokens.numel() == 0:
        raise ValueError("an empty sample: tokens, labels and loss_mask need at least 1 token.")
    tiles = torch.as_tensor(list(tiles_per_image), dtype=torch.int64).reshape(-1)
    placeholders = int((tokens == IMAGE_TOKEN).sum())
    if placeholders != tiles.numel():
        raise ValueError(
            f"the text holds {placeholders} image placeholder(s) ({IMAGE_TOKEN}) but "
            f"tiles_per_image gives {tiles.numel()} image(s); give one tile count per placeholder."
        )
    if bool((tiles < 1).any()):
        raise ValueError(f"tiles_per_image={tiles.tolist()}: every image needs at least 1 tile.")
    if images.dim() != 4 or images.shape[0] != int(tiles.sum()):
        raise ValueError(
            f"images of shape {tuple(images.shape)}: expected [tiles, C, H, W] with "
            f"sum(tiles_per_image) = {int(tiles.sum())} tiles."
        )
    return tokens.to(torch.int64), labels.to(torch.int64), loss_mask, tiles
