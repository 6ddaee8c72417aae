"""Mock variable-length data: random tokens with per-sample lengths from a :class:`LengthSampler`,
either a distribution spec (``--varlen-distribution``) or a lengths file
(``--varlen-lengths-file``), and optionally a prompt outside the loss at the start of each sample
(``--varlen-prompt-fraction``), as SFT data has."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Protocol, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_dcp.integration.data.lengths import (
    Distribution,
    parse_distribution,
    read_lengths,
    renamed,
)
from megatron_dcp.integration.data.samples import (
    Sample,
    check_index,
    make_sample,
    megatron_split,
    stable_seed,
)

DISTRIBUTION_FLAG = "--varlen-distribution"
LENGTHS_FILE_FLAG = "--varlen-lengths-file"
PROMPT_FRACTION_FLAG = "--varlen-prompt-fraction"


# Probability that a mock token is its predecessor's successor (else uniform): the chain's
# entropy is about 0.1 · ln V + 0.33 nats a token (0.81 at V = 128), far below ln V.
FOLLOW = 0.9


class LengthSampler(Protocol):
    """Gives the length of sample ``index``; ``rng`` is seeded from (seed, split, index)."""

    def length(self, index: int, rng: random.Random) -> int: ...


@dataclass(frozen=True)
class DistributionLengths:
    """Lengths drawn from a parsed distribution spec, one fresh draw per sample."""

    distribution: Distribution
    spec: str

    def length(self, index: int, rng: random.Random) -> int:
        return self.distribution.draw(rng)


@dataclass(frozen=True)
class FileLengths:
    """Lengths read from a file, cycled: sample ``i`` has ``lengths[i % len(lengths)]``."""

    lengths: Tuple[int, ...]
    path: str

    def length(self, index: int, rng: random.Random) -> int:
        return self.lengths[index % len(self.lengths)]


def parse_length_distribution(spec: str) -> DistributionLengths:
    """Parse a ``--varlen-distribution`` spec (syntax of ``integration.data.lengths``)."""
    try:
        distribution = parse_distribution(spec)
    except ValueError as error:
        raise renamed(error, DISTRIBUTION_FLAG) from None
    return DistributionLengths(distribution, spec)


def lengths_from_file(path: str) -> FileLengths:
    """Read a ``--varlen-lengths-file``: one positive length a line, ``#`` comments allowed."""
    try:
        lengths = read_lengths(path, minimum=1)  # a sequence needs at least 1 token
    except ValueError as error:
        raise renamed(error, LENGTHS_FILE_FLAG) from None
    return FileLengths(tuple(lengths), path)


class VarlenMockDataset(Dataset):
    """Tokens in ``[1, vocab_size)`` from a seeded Markov chain (learnable: a model's loss falls
    from ln V towards the chain's entropy), with per-sample lengths from a :class:`LengthSampler`.

    Sample ``i`` is a pure function of ``(seed, split_name, i)``; the chain's successor table
    depends on ``seed`` alone, so every split teaches the same structure. ``max_length``
    (usually ``--seq-length``) truncates longer draws. ``split`` is megatron's ``Split`` member.
    ``prompt_fraction`` (``--varlen-prompt-fraction``) keeps the first :func:`prompt_length`
    labels of each sample out of the loss, as SFT data keeps its prompts: so that a run on mock
    data exercises a loss mask with zeros, not only ones. It changes no token, label or length.
    """

    def __init__(
        self,
        num_samples: int,
        lengths: LengthSampler,
        vocab_size: int,
        seed: int,
        max_length: Optional[int] = None,
        split: str = "train",
        prompt_fraction: float = 0.0,
    ) -> None:
        assert num_samples >= 0 and vocab_size >= 2, (num_samples, vocab_size)
        assert max_length is None or max_length >= 1, max_length
        assert 0 <= prompt_fraction < 1, prompt_fraction
        self.num_samples = num_samples
        self.lengths = lengths
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_length = max_length
        self.split_name = split
        self.split = megatron_split(split)
        self.successors = successor_table(vocab_size, seed)
        self.prompt_fraction = prompt_fraction

    def __len__(self) -> int:
        return self.num_samples

    def sequence_length(self, index: int) -> int:
        """L of sample ``index``, without generating its tokens."""
        index = check_index(index, self.num_samples)
        rng = random.Random(stable_seed("varlen-length", self.seed, self.split_name, index))
        length = max(1, self.lengths.length(index, rng))
        return length if self.max_length is None else min(length, self.max_length)

    def __getitem__(self, index: int) -> Sample:
        length = self.sequence_length(index)
        rng = np.random.default_rng(stable_seed("varlen-tokens", self.seed, self.split_name, index))
        sequence = torch.from_numpy(markov_tokens(rng, length + 1, self.successors))
        return make_sample(sequence, prompt_length(length, self.prompt_fraction))


def prompt_length(length: int, fraction: float) -> int:
    """The prompt (labels outside the loss) of a mock sample of ``length`` tokens:
    floor(``fraction`` × ``length``). The product is exact, on the decimal the user wrote (the
    float's shortest repr): float arithmetic gives 0.29 × 100 = 28.999…, a prompt of 28, not 29.
    A ``fraction`` below 1 (as written too: a float below 1 never reads as 1 or more) leaves at
    least one token in the loss: a sample with none would count 0 tokens and teach nothing."""
    return math.floor(Fraction(repr(float(fraction))) * length)


def successor_table(vocab_size: int, seed: int) -> np.ndarray:
    """Each token's likely successor (in ``[1, vocab_size)``), fixed by ``seed`` for every split:
    what the mock data teaches a model."""
    rng = np.random.default_rng(stable_seed("varlen-successors", seed))
    return rng.integers(1, vocab_size, size=vocab_size, dtype=np.int64)


def markov_tokens(rng: np.random.Generator, count: int, successors: np.ndarray) -> np.ndarray:
    """``count`` tokens of a Markov chain: the first uniform, then each token's successor with
    probability :data:`FOLLOW`, else a uniform token (in ``[1, len(successors))``)."""
    vocab_size = len(successors)
    uniform = rng.integers(1, vocab_size, size=count, dtype=np.int64)
    follows = (rng.random(count) < FOLLOW).tolist()
    tokens, table = uniform.tolist(), successors.tolist()
    for i in range(1, count):
        if follows[i]:
            tokens[i] = table[tokens[i - 1]]
    return np.asarray(tokens, dtype=np.int64)
