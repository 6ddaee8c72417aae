"""Mock vision-language data for benchmarks and tests: mock.py's Markov text with image
placeholders, and random pixels.

Each sample draws its number of images from ``--vlm-images-per-sample`` and each image's tiles
from ``--vlm-tiles-per-image`` (discrete distributions, :func:`parse_discrete`), its text length W
from the ``--varlen-distribution`` / ``--varlen-lengths-file`` machinery, reduced so that the
combined length W + Σ tiles · S stays within ``--seq-length``. The placeholders sit at random
text positions (a quarter of the samples with images start with one); the last input is always
text, so a sample keeps a label in the loss. ``--varlen-prompt-fraction`` keeps the first
floor(F × T) text labels out of the loss, as mock.py does. Sample ``i`` is a pure function of
``(seed, split, i)``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_dcp.integration.data.mock import (
    LengthSampler,
    markov_tokens,
    prompt_length,
    successor_table,
)
from megatron_dcp.integration.data.samples import (
    Sample,
    check_index,
    megatron_split,
    stable_seed,
)
from megatron_dcp.integration.data.vlm_samples import IMAGE_TOKEN, make_vlm_sample

IMAGES_FLAG = "--vlm-images-per-sample"
TILES_FLAG = "--vlm-tiles-per-image"
START_PROBABILITY = 0.25  # a sample with images starts with a placeholder this often


@dataclass(frozen=True)
class Discrete:
    """A distribution over non-negative integers: ``values[i]`` with ``weights[i] / Σ weights``."""

    values: Tuple[int, ...]
    weights: Tuple[float, ...]
    spec: str

    def draw(self, rng: random.Random) -> int:
        return rng.choices(self.values, weights=self.weights)[0]

    @property
    def largest(self) -> int:
        return max(self.values)


def parse_discrete(spec: str, flag: str, minimum: int = 0) -> Discrete:
    """Parse ``VALUE:WEIGHT,VALUE:WEIGHT,...`` (weights > 0, normalised; one ``VALUE`` alone
    means always that value). ValueError naming ``flag``, the spec and the fix."""
    example = "'0:0.4,1:0.4,3:0.2'" if minimum == 0 else "'1:0.7,4:0.3'"
    values: List[int] = []
    weights: List[float] = []
    for item in filter(None, (part.strip() for part in str(spec).split(","))):
        value, sep, weight = item.partition(":")
        try:
            number = int(value.strip())
            share = float(weight) if sep else 1.0
        except ValueError:
            number, share = -1, math.nan
        if number < minimum or not (math.isfinite(share) and share > 0) or number in values:
            raise ValueError(
                f"{flag}={spec!r}: {item!r} is not VALUE:WEIGHT with a distinct integer VALUE ≥ "
                f"{minimum} and a WEIGHT > 0; write e.g. {example}."
            )
        values.append(number)
        weights.append(share)
    if not values:
        raise ValueError(f"{flag}={spec!r}: no VALUE:WEIGHT pair; write e.g. {example}.")
    return Discrete(tuple(values), tuple(weights), str(spec))


@dataclass(frozen=True)
class VLMMockShape:
    """What a mock VLM sample looks like: image counts, tiles, image size and the longest
    combined sequence."""

    images_per_sample: Discrete
    tiles_per_image: Discrete
    image_seq_length: int
    seq_length: int
    num_channels: int = 3
    img_h: int = 224
    img_w: int = 224


def check_shape(shape: VLMMockShape) -> None:
    """ValueError when the most image tokens a sample can draw leave no room for text."""
    most = shape.images_per_sample.largest * shape.tiles_per_image.largest
    tokens = most * shape.image_seq_length
    if tokens + 1 > shape.seq_length:
        raise ValueError(
            f"{IMAGES_FLAG}={shape.images_per_sample.spec!r} and {TILES_FLAG}="
            f"{shape.tiles_per_image.spec!r}: up to {most} tile(s) of {shape.image_seq_length} "
            f"tokens ({tokens}) leave no text token within --seq-length {shape.seq_length}; "
            f"raise --seq-length to at least {tokens + 1}, or lower the largest image or tile "
            "count."
        )


class VLMMockDataset(Dataset):
    """Mock samples with images (:func:`make_vlm_sample` dicts): Markov text tokens in
    ``[1, vocab_size)`` (mock.py's chain, the same successor table), placeholders at random
    positions, standard-normal pixels (already "normalised") seeded per sample."""

    def __init__(
        self,
        num_samples: int,
        lengths: LengthSampler,
        vocab_size: int,
        seed: int,
        shape: VLMMockShape,
        split: str = "train",
        prompt_fraction: float = 0.0,
    ) -> None:
        assert num_samples >= 0 and vocab_size >= 2, (num_samples, vocab_size)
        assert 0 <= prompt_fraction < 1, prompt_fraction
        check_shape(shape)
        self.num_samples, self.lengths, self.vocab_size = num_samples, lengths, vocab_size
        self.seed, self.shape, self.prompt_fraction = seed, shape, prompt_fraction
        self.split_name, self.split = split, megatron_split(split)
        self.successors = successor_table(vocab_size, seed)

    def __len__(self) -> int:
        return self.num_samples

    def layout(self, index: int) -> Tuple[int, List[int]]:
        """``(W, tiles)``: the text tokens (placeholders not counted) and each image's tiles."""
        index = check_index(index, self.num_samples)
        rng = random.Random(stable_seed("vlm-images", self.seed, self.split_name, index))
        shape = self.shape
        tiles = [shape.tiles_per_image.draw(rng) for _ in range(shape.images_per_sample.draw(rng))]
        rng = random.Random(stable_seed("varlen-length", self.seed, self.split_name, index))
        room = shape.seq_length - sum(tiles) * shape.image_seq_length
        return min(max(1, self.lengths.length(index, rng)), room), tiles

    def sequence_length(self, index: int) -> int:
        """The combined length L of sample ``index``, without generating it."""
        words, tiles = self.layout(index)
        return words + sum(tiles) * self.shape.image_seq_length

    def __getitem__(self, index: int) -> Sample:
        words, tiles = self.layout(index)
        rng = np.random.default_rng(stable_seed("vlm-tokens", self.seed, self.split_name, index))
        text = markov_tokens(rng, words + 1, self.successors).tolist()
        gaps = sorted(int(gap) for gap in rng.integers(0, words, size=len(tiles)))
        if tiles and rng.random() < START_PROBABILITY:
            gaps[0] = 0
        for gap in reversed(gaps):  # a placeholder before text token ``gap``
            text.insert(gap, IMAGE_TOKEN)
        sequence = torch.tensor(text, dtype=torch.int64)
        tokens, labels = sequence[:-1], sequence[1:].clone()
        loss_mask = torch.ones(tokens.numel(), dtype=torch.float32)
        loss_mask[: prompt_length(tokens.numel(), self.prompt_fraction)] = 0.0
        shape = self.shape
        pixels = rng.standard_normal(
            (sum(tiles), shape.num_channels, shape.img_h, shape.img_w), dtype=np.float32
        )
        images = torch.from_numpy(pixels)
        return make_vlm_sample(tokens, labels, loss_mask, images, tiles, shape.image_seq_length)
