"""Real documents from a megatron indexed dataset (``--data-path PREFIX``: ``.bin``/``.idx``),
one per sample, and the ``--split`` weights that divide the documents into train/valid/test."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_dcp.integration.data.samples import (
    Sample,
    make_sample,
    megatron_split,
    pass_position,
)

DATA_PATH_FLAG = "--data-path"
SPLIT_FLAG = "--split"
DEFAULT_SPLIT = "969,30,1"


def open_indexed(path_prefix: str) -> Any:
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
        self.data = open_indexed(path_prefix)
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
        position = pass_position(index, self.num_samples, self.documents.size, self.seed)
        return int(self.documents[position])

    def sequence_length(self, index: int) -> int:
        """L of sample ``index``, without reading its tokens."""
        tokens = int(self.data.sequence_lengths[self.document(index)])
        return min(tokens, self.max_length + 1) - 1

    def __getitem__(self, index: int) -> Sample:
        document = self.document(index)
        count = min(int(self.data.sequence_lengths[document]), self.max_length + 1)
        sequence = np.asarray(self.data.get(document, offset=0, length=count), dtype=np.int64)
        return make_sample(torch.from_numpy(sequence))


def single_prefix(data_path: Union[str, Sequence[str]]) -> str:
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


def check_split_range(
    split: str, name: str, count: int, item_range: Tuple[int, int], source: str, items: str
) -> None:
    """ValueError when split ``name`` needs ``count`` samples but its ``[begin, end)`` range of
    ``source``'s ``items`` (documents, conversations) is empty."""
    if count > 0 and item_range[0] == item_range[1]:
        raise ValueError(
            f"{SPLIT_FLAG}={split!r}: the {name} split of {source} has no {items} but {count} "
            f"{name} samples are needed; give {name} a larger weight or more {items}, or set "
            "its sample count (iterations) to 0."
        )
