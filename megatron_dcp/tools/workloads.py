"""The four reference workloads of the benchmark, the vision-language workload ``vlm`` of the
simulator (lengths and encoder patches), and a one-line summary of a batch of lengths."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron_dcp.integration.data import lengths
from megatron_dcp.integration.data.lengths import sample_lengths

DISTRIBUTION_FLAG = "--distribution"
LENGTHS_FLAG = "--lengths"


def parse_distribution(spec: str) -> lengths.Distribution:
    """:func:`lengths.parse_distribution` with errors naming ``--distribution``."""
    try:
        return lengths.parse_distribution(spec)
    except ValueError as error:
        raise lengths.renamed(error, DISTRIBUTION_FLAG) from None


def read_lengths(path: str) -> List[int]:
    """:func:`lengths.read_lengths` with errors naming ``--lengths``."""
    try:
        return lengths.read_lengths(path)
    except ValueError as error:
        raise lengths.renamed(error, LENGTHS_FLAG) from None


# LLaVA's image tokens: one tile of a 336-pixel ViT-L/14 is 24 × 24 = 576 tokens in the language
# model and 577 encoder patches (the class token included).
IMAGE_TOKENS_PER_TILE = 576
PATCHES_PER_TILE = 577


@dataclass(frozen=True)
class VisionMix:
    """How the ``vlm`` workload draws one sample, a three-way mixture:

    - ``text_share`` text-only turns: log-normal median ``text_median`` (σ 0.6, 16–4096 tokens),
      no patches;
    - ``tail_share`` long multi-image samples: 8–24 images, text log-normal median 1500 (σ 0.8,
      64–8192);
    - the rest, image samples: 1–8 images (1 with probability 1/2, then 2: 1/5, 3: 1/10,
      4: 2/25, 5–8: 3/100 each), text log-normal median 200 (σ 0.8, 8–4096).

    Every image has 1–4 tiles (uniform); a tile is ``IMAGE_TOKENS_PER_TILE`` tokens of the
    combined length and ``PATCHES_PER_TILE`` encoder patches."""

    text_share: float = 0.4
    tail_share: float = 0.1
    text_median: float = 300.0

    def draw(self, rng: random.Random) -> Tuple[int, int]:
        """One sample: (combined length, encoder patches)."""
        kind = rng.random()
        if kind < self.text_share:
            return _lognormal(rng, self.text_median, 0.6, 16, 4096), 0
        if kind < self.text_share + self.tail_share:
            images, text = rng.randint(8, 24), _lognormal(rng, 1500.0, 0.8, 64, 8192)
        else:
            images = rng.choices(range(1, 9), weights=(50, 20, 10, 8, 3, 3, 3, 3))[0]
            text = _lognormal(rng, 200.0, 0.8, 8, 4096)
        tiles = sum(rng.randint(1, 4) for _ in range(images))
        return text + tiles * IMAGE_TOKENS_PER_TILE, tiles * PATCHES_PER_TILE


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(median * math.exp(rng.gauss(0.0, sigma)))))


@dataclass(frozen=True)
class Workload:
    """A benchmark workload: domain layout, per-rank budget and length distribution; with
    ``vision``, a vision-language workload whose samples also have encoder patches (drawn
    together with their lengths, from the same seed)."""

    name: str
    description: str
    dp_size: int
    cp_size: int
    budget: int
    distribution: str
    vision: Optional[VisionMix] = None

    @property
    def domain_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def total_tokens(self) -> int:
        """Tokens per global batch: 8 full micro-batches' worth (8 × N × budget)."""
        return 8 * self.domain_size * self.budget

    def lengths(self, seed: int = 0) -> List[int]:
        if self.vision is not None:
            return self.samples(seed)[0]
        dist = parse_distribution(self.distribution)
        return sample_lengths(dist, seed, total_tokens=self.total_tokens)

    def patches(self, seed: int = 0) -> List[int]:
        """Each sample's encoder patches, in the order of :meth:`lengths` (0 for text)."""
        if self.vision is None:
            return [0] * len(self.lengths(seed))
        return self.samples(seed)[1]

    def samples(
        self, seed: int = 0, total_tokens: Optional[int] = None, count: Optional[int] = None
    ) -> Tuple[List[int], List[int]]:
        """(combined lengths, patches) of a vision workload: ``count`` samples, or samples until
        ``total_tokens`` (default :attr:`total_tokens`), deterministic in ``seed``."""
        assert self.vision is not None, f"{self.name} has no vision samples"
        rng, lengths, patches = random.Random(seed), [], []
        goal = self.total_tokens if total_tokens is None else total_tokens
        while (len(lengths) < count) if count is not None else (sum(lengths) < goal):
            length, patch_count = self.vision.draw(rng)
            lengths.append(length)
            patches.append(patch_count)
        return lengths, patches


REFERENCE_WORKLOADS: Tuple[Workload, ...] = (
    Workload(
        "lognormal",
        "log-normal, mean 1024, σ 1.5, 128–8192",
        2,
        4,
        2048,
        "lognormal:mean=1024,sigma=1.5,min=128,max=8192",
    ),
    Workload(
        "rl-rollouts",
        "RL rollouts: log-normal median 4096, σ 0.8, ≤32K",
        16,
        4,
        8192,
        "lognormal:median=4096,sigma=0.8,max=32768",
    ),
    Workload(
        "long-sft",
        "long-context SFT: 99% log-normal median 1024 + 1% 32K–256K",
        4,
        16,
        16384,
        "mixture:0.99*lognormal:median=1024,sigma=1.0|0.01*uniform:min=32768,max=262144",
    ),
    Workload("uniform", "uniform 1–32768", 4, 4, 4096, "uniform:min=1,max=32768"),
)

# The simulator's vision-language workload (not in the benchmark matrix): its ``distribution`` is
# the text-only turns' (what ``--distribution`` replaces, without patches).
VLM_WORKLOAD = Workload(
    "vlm",
    "VLM: 40% text turns, 50% 1–8 images, 10% 8–24 images; 1–4 tiles of 576 tokens per image",
    2,
    8,
    8192,
    "lognormal:median=300,sigma=0.6,min=16,max=4096",
    VisionMix(),
)
# Every workload ``simulate --workload`` knows: the reference ones, then ``vlm``.
WORKLOADS: Tuple[Workload, ...] = (*REFERENCE_WORKLOADS, VLM_WORKLOAD)


def reference_workload(name: str, workloads: Sequence[Workload] = REFERENCE_WORKLOADS) -> Workload:
    """Look up a workload of ``workloads`` (default: the reference ones) by name or 1-based
    index."""
    for index, workload in enumerate(workloads, start=1):
        if name in (workload.name, str(index)):
            return workload
    names = ", ".join(w.name for w in workloads)
    raise ValueError(
        f"--workload={name!r}: unknown workload; choose one of {names} (or 1–{len(workloads)})."
    )


def summarize(lengths: Sequence[int], patches: Sequence[int] = ()) -> str:
    """One line: count, total, mean, max (and, with ``patches``, the samples with images and
    their encoder patches)."""
    total = sum(lengths)
    mean = total / len(lengths) if lengths else 0.0
    line = (
        f"{len(lengths)} sequences, {total} tokens, mean {mean:.0f}, max {max(lengths, default=0)}"
    )
    if any(patches):
        with_images = sum(1 for p in patches if p)
        line += f"; {with_images} with images, {sum(patches)} encoder patches"
    return line
