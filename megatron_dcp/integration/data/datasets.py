"""Variable-length datasets for the DCP training entry point (``megatron_dcp.pretrain_gpt``).

Every dataset yields ONE variable-length sequence per index, as a dict of 1-D tensors::

    tokens     int64   [L]   input tokens
    labels     int64   [L]   the next token of each position (tokens shifted left by one)
    loss_mask  float32 [L]   1 where the label is real (all ones: every label is a real token)
    length     int64   []    L

Megatron's data loader (micro-batch size 1, default collate) turns that into ``[1, L]`` tensors
and a ``[1]`` length. An item depends only on (seed, split, index): never on rank, worker or the
order of access, so resuming at any consumed-sample count reproduces the data exactly.

Sources (exactly one; see ``docs/datasets.md``):

* ``--varlen-distribution SPEC``: mock data, lengths drawn from a distribution spec parsed by
  :func:`megatron_dcp.integration.data.lengths.parse_distribution` (the simulator's syntax).
* ``--varlen-lengths-file PATH``: mock data, lengths cycled from a file (one length a line).
* ``--data-path PREFIX``: real documents from a megatron indexed dataset (``.bin``/``.idx``).
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_dcp.integration.data.lengths import (
    Distribution,
    parse_distribution,
    read_lengths,
    renamed,
)

DISTRIBUTION_FLAG = "--varlen-distribution"
LENGTHS_FILE_FLAG = "--varlen-lengths-file"
DATA_PATH_FLAG = "--data-path"
SPLIT_FLAG = "--split"
DEFAULT_DISTRIBUTION = "lognormal:mean=1024,sigma=1.5,min=128,max=8192"
DEFAULT_SPLIT = "969,30,1"
SPLITS = ("train", "valid", "test")

Sample = Dict[str, torch.Tensor]


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


def _first_zero_line(path: str) -> Optional[Tuple[int, str]]:
    """(line number, text) of the first length 0 in a lengths file, None when there is none."""
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if text and int(text) == 0:
            return number, text
    return None


def lengths_from_file(path: str) -> FileLengths:
    """Read a ``--varlen-lengths-file``: one positive length a line, ``#`` comments allowed."""
    try:
        lengths = read_lengths(path)
    except ValueError as error:
        raise renamed(error, LENGTHS_FILE_FLAG) from None
    zero = _first_zero_line(path) if 0 in lengths else None
    if zero is not None:
        raise ValueError(
            f"{LENGTHS_FILE_FLAG}={path!r}: line {zero[0]} reads {zero[1]!r}; a sequence needs "
            f"at least 1 token: write a positive length or delete the line."
        )
    return FileLengths(tuple(lengths), path)


def _seed(*parts: object) -> int:
    """A 64-bit seed from the parts; stable across processes (no ``hash()``)."""
    text = ":".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def megatron_split(name: str) -> Any:
    """megatron's ``Split`` enum member for 'train'/'valid'/'test'. Datasets carry it as
    ``.split`` because megatron's ``build_pretraining_data_loader`` reads it to pick the eval
    micro-batch size and the full-validation sampler."""
    from megatron_dcp.integration.megatron_import import import_megatron_core

    import_megatron_core()
    from megatron.core.datasets.utils import Split

    return Split[name]


def _check_index(index: int, size: int) -> int:
    if not 0 <= index < size:
        raise IndexError(f"sample index {index} is outside [0, {size})")
    return int(index)


def _sample(sequence: torch.Tensor) -> Sample:
    """The item of a sequence of L+1 tokens: inputs, next-token labels, mask and length."""
    tokens, labels = sequence[:-1].clone(), sequence[1:].clone()
    length = tokens.numel()
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones(length, dtype=torch.float32),
        "length": torch.tensor(length, dtype=torch.int64),
    }


class VarlenMockDataset(Dataset):
    """Random tokens in ``[1, vocab_size)`` with per-sample lengths from a :class:`LengthSampler`.

    Sample ``i`` is a pure function of ``(seed, split_name, i)``; ``max_length`` (usually
    ``--seq-length``) truncates longer draws. ``split`` is megatron's ``Split`` member.
    """

    def __init__(
        self,
        num_samples: int,
        lengths: LengthSampler,
        vocab_size: int,
        seed: int,
        max_length: Optional[int] = None,
        split: str = "train",
    ) -> None:
        assert num_samples >= 0 and vocab_size >= 2, (num_samples, vocab_size)
        assert max_length is None or max_length >= 1, max_length
        self.num_samples = num_samples
        self.lengths = lengths
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_length = max_length
        self.split_name = split
        self.split = megatron_split(split)

    def __len__(self) -> int:
        return self.num_samples

    def sequence_length(self, index: int) -> int:
        """L of sample ``index``, without generating its tokens."""
        index = _check_index(index, self.num_samples)
        rng = random.Random(_seed("varlen-length", self.seed, self.split_name, index))
        length = max(1, self.lengths.length(index, rng))
        return length if self.max_length is None else min(length, self.max_length)

    def __getitem__(self, index: int) -> Sample:
        length = self.sequence_length(index)
        rng = np.random.default_rng(_seed("varlen-tokens", self.seed, self.split_name, index))
        sequence = rng.integers(1, self.vocab_size, size=length + 1, dtype=np.int64)
        return _sample(torch.from_numpy(sequence))


@functools.lru_cache(maxsize=4)
def _permutation(size: int, seed: int, epoch: int) -> np.ndarray:
    """The document order of one pass (epoch) over ``size`` documents."""
    return np.random.default_rng(_seed("varlen-documents", seed, epoch)).permutation(size)


def _open_indexed(path_prefix: str) -> Any:
    """megatron's ``IndexedDataset`` over ``path_prefix.bin`` / ``path_prefix.idx``."""
    megatron_split("train")  # imports megatron.core
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(path_prefix)


def _labelled_documents(sequence_lengths: np.ndarray, low: int, high: int) -> np.ndarray:
    """Indices in ``[low, high)`` of the documents with at least 2 tokens (one label)."""
    long_enough = np.asarray(sequence_lengths[low:high]) >= 2
    return (np.flatnonzero(long_enough) + low).astype(np.int64)


class IndexedDocumentDataset(Dataset):
    """One document of a megatron indexed dataset per sample, truncated to ``max_length + 1``
    tokens (so L ≤ ``max_length``).

    A document is one sequence of the ``.idx`` (what megatron's GPTDataset also calls a
    document). Documents with fewer than 2 tokens have no label and are skipped. Documents are
    taken from ``document_range`` (default: all) in file order when ``seed`` is None, else in a
    fresh seeded permutation per pass; passes repeat while ``num_samples`` exceeds the count.
    """

    def __init__(
        self,
        path_prefix: str,
        max_length: int,
        num_samples: int,
        seed: Optional[int] = None,
        document_range: Optional[Tuple[int, int]] = None,
        split: str = "train",
    ) -> None:
        assert max_length >= 1 and num_samples >= 0, (max_length, num_samples)
        self.split_name = split
        self.split = megatron_split(split)
        self.data = _open_indexed(path_prefix)
        self.path_prefix = path_prefix
        self.max_length = max_length
        self.num_samples = num_samples
        self.seed = seed
        low, high = document_range if document_range is not None else (0, len(self.data))
        self.documents = _labelled_documents(self.data.sequence_lengths, low, high)
        if num_samples > 0 and self.documents.size == 0:
            raise ValueError(
                f"{DATA_PATH_FLAG}={path_prefix!r}: documents [{low}, {high}) hold no document "
                f"of 2 or more tokens; point the flag at a larger dataset or change {SPLIT_FLAG}."
            )

    def __len__(self) -> int:
        return self.num_samples

    def document(self, index: int) -> int:
        """The index (in the ``.idx``) of the document behind sample ``index``."""
        epoch, position = divmod(_check_index(index, self.num_samples), self.documents.size)
        if self.seed is not None:
            position = int(_permutation(self.documents.size, self.seed, epoch)[position])
        return int(self.documents[position])

    def sequence_length(self, index: int) -> int:
        """L of sample ``index``, without reading its tokens."""
        tokens = int(self.data.sequence_lengths[self.document(index)])
        return min(tokens, self.max_length + 1) - 1

    def __getitem__(self, index: int) -> Sample:
        document = self.document(index)
        count = min(int(self.data.sequence_lengths[document]), self.max_length + 1)
        sequence = np.asarray(self.data.get(document, offset=0, length=count), dtype=np.int64)
        return _sample(torch.from_numpy(sequence))


def _single_prefix(data_path: Union[str, Sequence[str]]) -> str:
    """The one prefix of ``--data-path`` (a bare prefix, or ``WEIGHT PREFIX``)."""
    parts = [data_path] if isinstance(data_path, str) else list(data_path)
    if len(parts) == 2 and _is_number(parts[0]):
        parts = parts[1:]
    if len(parts) != 1:
        raise ValueError(
            f"{DATA_PATH_FLAG}={' '.join(map(str, parts))!r}: variable-length training reads one "
            f"dataset prefix; blends are not supported: merge the datasets into one .bin/.idx "
            f"(megatron tools/merge_datasets.py) and pass its prefix."
        )
    return parts[0]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> Tuple[float, float, float]:
    """``--split`` weights ``'969,30,1'`` normalised to fractions (missing ones are 0)."""
    try:
        weights = [float(part) for part in split.replace("/", ",").split(",") if part.strip()]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(
            f"{SPLIT_FLAG}={split!r}: give up to three non-negative train,valid,test weights "
            f"with a positive sum, e.g. '{DEFAULT_SPLIT}'."
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return (weights[0] / total, weights[1] / total, weights[2] / total)


def split_document_ranges(split: str, num_documents: int) -> Tuple[Tuple[int, int], ...]:
    """Contiguous ``[begin, end)`` document ranges of train, valid and test (megatron rounding)."""
    fractions = parse_split(split)
    bounds = [0.0, fractions[0], fractions[0] + fractions[1], 1.0]
    edges = [int(round(bound * num_documents)) for bound in bounds]
    return tuple((edges[i], edges[i + 1]) for i in range(3))


@dataclass(frozen=True)
class VarlenDataConfig:
    """Plain parameters of :func:`build_varlen_datasets` (the entry point fills them from args)."""

    seq_length: int
    vocab_size: int
    seed: int
    num_samples: Tuple[int, int, int]
    distribution: Optional[str] = None
    lengths_file: Optional[str] = None
    data_path: Optional[Union[str, Sequence[str]]] = None
    split: str = DEFAULT_SPLIT


def _check_sources(config: VarlenDataConfig) -> None:
    given = {
        DISTRIBUTION_FLAG: config.distribution,
        LENGTHS_FILE_FLAG: config.lengths_file,
        DATA_PATH_FLAG: config.data_path,
    }
    named = [f"{flag}={value!r}" for flag, value in given.items() if value]
    if len(named) > 1:
        raise ValueError(
            f"{' and '.join(named)}: give at most one data source (mock distribution, lengths "
            f"file or indexed dataset); remove the others."
        )
    if config.seq_length < 1:
        raise ValueError(f"--seq-length={config.seq_length}: must be ≥ 1 (the longest sequence).")
    if config.vocab_size < 2 and not config.data_path:
        raise ValueError(
            f"vocab size {config.vocab_size}: mock data needs at least 2 tokens; set "
            f"--vocab-size (or the tokenizer) to a larger vocabulary."
        )


def _mock_datasets(
    config: VarlenDataConfig, lengths: LengthSampler
) -> Tuple[Optional[VarlenMockDataset], ...]:
    return tuple(
        (
            VarlenMockDataset(
                count, lengths, config.vocab_size, config.seed, config.seq_length, name
            )
            if count > 0
            else None
        )
        for name, count in zip(SPLITS, config.num_samples)
    )


def _indexed_datasets(config: VarlenDataConfig) -> Tuple[Optional[IndexedDocumentDataset], ...]:
    prefix = _single_prefix(config.data_path)
    if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
        raise ValueError(
            f"{DATA_PATH_FLAG}={prefix!r}: {prefix}.bin and {prefix}.idx not found; pass the "
            f"prefix written by megatron's tools/preprocess_data.py (without .bin/.idx)."
        )
    total = len(_open_indexed(prefix))
    ranges = split_document_ranges(config.split, total)
    return tuple(
        _split_dataset(prefix, config, name, count, document_range)
        for name, count, document_range in zip(SPLITS, config.num_samples, ranges)
    )


def _split_dataset(
    prefix: str, config: VarlenDataConfig, name: str, count: int, document_range: Tuple[int, int]
) -> Optional[IndexedDocumentDataset]:
    if count == 0:
        return None
    if document_range[0] == document_range[1]:
        raise ValueError(
            f"{SPLIT_FLAG}={config.split!r}: the {name} split of {DATA_PATH_FLAG}={prefix!r} "
            f"has no documents but {count} {name} samples are needed; give {name} a larger "
            f"weight or set its sample count (iterations) to 0."
        )
    return IndexedDocumentDataset(
        prefix, config.seq_length, count, config.seed, document_range, name
    )


def build_varlen_datasets(
    *,
    seq_length: int,
    vocab_size: int,
    seed: int,
    num_samples: Sequence[int],
    distribution: Optional[str] = None,
    lengths_file: Optional[str] = None,
    data_path: Optional[Union[str, Sequence[str]]] = None,
    split: Optional[str] = None,
) -> Tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]:
    """(train, valid, test) datasets from at most one source; None for a split of 0 samples.

    ``num_samples`` holds the train, valid and test sample counts. With no source given: mock data
    with lengths from :data:`DEFAULT_DISTRIBUTION`. ``split`` (default :data:`DEFAULT_SPLIT`)
    only applies to ``data_path``.
    """
    counts = tuple(int(count) for count in num_samples) + (0, 0, 0)
    config = VarlenDataConfig(
        seq_length,
        vocab_size,
        seed,
        counts[:3],
        distribution,
        lengths_file,
        data_path,
        split or DEFAULT_SPLIT,
    )
    _check_sources(config)
    if config.data_path:
        return _indexed_datasets(config)
    if config.lengths_file:
        return _mock_datasets(config, lengths_from_file(config.lengths_file))
    spec = config.distribution or DEFAULT_DISTRIBUTION
    return _mock_datasets(config, parse_length_distribution(spec))
