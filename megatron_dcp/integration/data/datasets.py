"""Variable-length datasets for the DCP training entry point (``megatron_dcp.pretrain_gpt``).

Every dataset yields ONE variable-length sequence per index, as a dict of 1-D tensors::

    tokens     int64   [L]   input tokens
    labels     int64   [L]   the next token of each position (tokens shifted left by one)
    loss_mask  float32 [L]   1 where the label is in the loss (all of them, but for
                             conversations only the assistant's)
    length     int64   []    L

Megatron's data loader (micro-batch size 1, default collate) turns that into ``[1, L]`` tensors
and a ``[1]`` length. An item depends only on (seed, split, index): never on rank, worker or the
order of access, so resuming at any consumed-sample count reproduces the data exactly.

Sources (exactly one; see ``docs/datasets.md``):

* ``--varlen-distribution SPEC``: mock data, lengths drawn from a distribution spec parsed by
  :func:`megatron_dcp.integration.data.lengths.parse_distribution` (the simulator's syntax).
* ``--varlen-lengths-file PATH``: mock data, lengths cycled from a file (one length a line).
  With either mock source, ``--varlen-prompt-fraction F`` keeps the first floor(F × L) labels of
  each sample out of the loss (a prompt, as SFT data has; at least one label stays in it).
* ``--data-path PREFIX``: real documents from a megatron indexed dataset (``.bin``/``.idx``).
* ``--sft-data PATH[,PATH...]``: conversations rendered with the tokenizer's chat template.

The sources live in ``mock`` (length samplers, :class:`VarlenMockDataset`), ``indexed``
(:class:`IndexedDocumentDataset`, ``--split`` parsing) and ``sft`` (with ``conversations`` and
``chat``), the item in ``samples``; this module holds the data flags, checks them and builds the
three splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
from torch.utils.data import Dataset

from megatron_dcp.integration.data.chat import ChatTokenizer
from megatron_dcp.integration.data.conversations import (
    LOSS_ON_PROMPT_FLAG,
    SFT_DATA_FLAG,
    SKIP_INVALID_FLAG,
)
from megatron_dcp.integration.data.indexed import (
    DATA_PATH_FLAG,
    DEFAULT_SPLIT,
    IndexedDocumentDataset,
    check_split_range,
    open_indexed,
    single_prefix,
    split_document_ranges,
)
from megatron_dcp.integration.data.mock import (
    DISTRIBUTION_FLAG,
    LENGTHS_FILE_FLAG,
    PROMPT_FRACTION_FLAG,
    LengthSampler,
    VarlenMockDataset,
    lengths_from_file,
    parse_length_distribution,
)
from megatron_dcp.integration.data.samples import report_truncation
from megatron_dcp.integration.data.sft import SFTOptions, build_sft_datasets

DEFAULT_DISTRIBUTION = "lognormal:mean=1024,sigma=1.5,min=128,max=8192"
SPLITS = ("train", "valid", "test")


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
    sft_data: Optional[Union[str, Sequence[str]]] = None
    loss_on_prompt: bool = False
    skip_invalid: bool = False
    prompt_fraction: float = 0.0


def add_data_args(group: Any) -> None:
    """The data-source flags of the DCP entry points (megatron's own ``--data-path``,
    ``--split``, ``--seq-length`` and tokenizer flags are read too)."""
    group.add_argument(
        DISTRIBUTION_FLAG,
        default=None,
        help="Mock variable-length data, e.g. 'lognormal:mean=1024,sigma=1.5,min=128,max=8192'.",
    )
    group.add_argument(
        LENGTHS_FILE_FLAG,
        default=None,
        help="Mock data whose lengths are read from this file (one per line).",
    )
    group.add_argument(
        PROMPT_FRACTION_FLAG,
        type=float,
        default=0.0,
        metavar="F",
        help="Mock data: the first floor(F × L) tokens of each sample of L tokens are a prompt "
        "outside the loss, as in SFT data (at least one token stays in the loss); F in [0, 1), "
        "default 0: every token in the loss.",
    )
    group.add_argument(
        SFT_DATA_FLAG,
        default=None,
        metavar="PATH[,PATH...]",
        help='Conversations (JSONL or JSON of {"messages": [{"role", "content"}, ...]}), one '
        "sample each, rendered with the tokenizer's chat template (HuggingFaceTokenizer or "
        "SFTTokenizer); only the assistant's tokens are in the loss.",
    )
    group.add_argument(
        LOSS_ON_PROMPT_FLAG,
        action="store_true",
        help=f"With {SFT_DATA_FLAG}: every token is in the loss, not only the assistant's.",
    )
    group.add_argument(
        SKIP_INVALID_FLAG,
        action="store_true",
        help=f"With {SFT_DATA_FLAG}: skip invalid records (counted in the log) instead of "
        "stopping at the first.",
    )


def _check_sources(config: VarlenDataConfig) -> None:
    """At most one source flag, a usable ``--seq-length`` and (for mock data) vocabulary."""
    given = {
        DISTRIBUTION_FLAG: config.distribution,
        LENGTHS_FILE_FLAG: config.lengths_file,
        DATA_PATH_FLAG: config.data_path,
        SFT_DATA_FLAG: config.sft_data,
    }
    named = [f"{flag}={value!r}" for flag, value in given.items() if value]
    if len(named) > 1:
        raise ValueError(
            f"{' and '.join(named)}: give at most one data source (mock distribution, lengths "
            f"file, indexed dataset or conversations); remove the others."
        )
    if config.seq_length < 1:
        raise ValueError(f"--seq-length={config.seq_length}: must be ≥ 1 (the longest sequence).")
    sft_switches = {
        LOSS_ON_PROMPT_FLAG: config.loss_on_prompt,
        SKIP_INVALID_FLAG: config.skip_invalid,
    }
    for flag, on in sft_switches.items():
        if on and not config.sft_data:
            raise ValueError(f"{flag} applies to conversations: add {SFT_DATA_FLAG} or remove it.")
    check_prompt_fraction(config.prompt_fraction, config.data_path, config.sft_data)
    if config.vocab_size < 2 and not (config.data_path or config.sft_data):
        raise ValueError(
            f"vocab size {config.vocab_size}: mock data needs at least 2 tokens; set "
            f"--vocab-size (or the tokenizer) to a larger vocabulary."
        )


def check_prompt_fraction(
    fraction: float,
    data_path: Optional[Union[str, Sequence[str]]] = None,
    sft_data: Optional[Union[str, Sequence[str]]] = None,
) -> None:
    """``--varlen-prompt-fraction`` is a share in [0, 1) (at 1 or more no token would be left to
    the loss) and, when not 0, comes with mock data: the documents and conversations of
    ``--data-path`` and ``--sft-data`` keep their own loss mask, and would ignore it silently.
    Called when the datasets are built and by the entry point's start-up checks."""
    if not 0 <= fraction < 1:  # NaN too
        raise ValueError(
            f"{PROMPT_FRACTION_FLAG}={fraction}: the share of each mock sample kept out of the "
            "loss must be at least 0 and below 1; give e.g. 0.3 (0, the default, keeps every "
            "token in the loss)."
        )
    real = {DATA_PATH_FLAG: data_path, SFT_DATA_FLAG: sft_data}
    for flag, value in real.items():
        if fraction and value:
            raise ValueError(
                f"{PROMPT_FRACTION_FLAG}={fraction} applies to mock data only, not to {flag} "
                f"(whose loss mask is its own): remove {PROMPT_FRACTION_FLAG}, or {flag} to "
                f"train on mock data ({DISTRIBUTION_FLAG} or {LENGTHS_FILE_FLAG})."
            )


def _mock_datasets(
    config: VarlenDataConfig, lengths: LengthSampler
) -> Tuple[Optional[VarlenMockDataset], ...]:
    """(train, valid, test) mock datasets with lengths from ``lengths``."""
    return tuple(
        (
            VarlenMockDataset(
                count,
                lengths,
                config.vocab_size,
                config.seed,
                config.seq_length,
                name,
                config.prompt_fraction,
            )
            if count > 0
            else None
        )
        for name, count in zip(SPLITS, config.num_samples)
    )


def _indexed_datasets(config: VarlenDataConfig) -> Tuple[Optional[IndexedDocumentDataset], ...]:
    """(train, valid, test) datasets over the ``--split`` document ranges of ``--data-path``."""
    prefix = single_prefix(config.data_path)
    if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
        raise ValueError(
            f"{DATA_PATH_FLAG}={prefix!r}: {prefix}.bin and {prefix}.idx not found; pass the "
            f"prefix written by megatron's tools/preprocess_data.py (without .bin/.idx)."
        )
    documents = open_indexed(prefix)
    total = len(documents)
    # A document of n tokens makes a sample of n - 1 (the labels are the tokens shifted by one).
    report_truncation(
        f"{DATA_PATH_FLAG}={prefix}", documents.sequence_lengths - 1, config.seq_length
    )
    ranges = split_document_ranges(config.split, total)
    return tuple(
        _split_dataset(prefix, config, name, count, document_range)
        for name, count, document_range in zip(SPLITS, config.num_samples, ranges)
    )


def _split_dataset(
    prefix: str, config: VarlenDataConfig, name: str, count: int, document_range: Tuple[int, int]
) -> Optional[IndexedDocumentDataset]:
    """One split's dataset; None for 0 samples, ValueError when its range has no documents."""
    if count == 0:
        return None
    source = f"{DATA_PATH_FLAG}={prefix!r}"
    check_split_range(config.split, name, count, document_range, source, "documents")
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
    sft_data: Optional[Union[str, Sequence[str]]] = None,
    chat: Optional[ChatTokenizer] = None,
    loss_on_prompt: bool = False,
    skip_invalid: bool = False,
    prompt_fraction: float = 0.0,
) -> Tuple[Optional[Dataset], Optional[Dataset], Optional[Dataset]]:
    """(train, valid, test) datasets from at most one source; None for a split of 0 samples.

    ``num_samples`` holds the train, valid and test sample counts. With no source given: mock data
    with lengths from :data:`DEFAULT_DISTRIBUTION`. ``split`` (default :data:`DEFAULT_SPLIT`)
    applies to ``data_path`` and ``sft_data``; ``sft_data`` needs ``chat``, the tokenizer.
    ``prompt_fraction`` (mock data only) keeps each sample's leading floor(F × L) labels out of
    the loss.
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
        sft_data,
        loss_on_prompt,
        skip_invalid,
        prompt_fraction,
    )
    _check_sources(config)
    if config.sft_data:
        options = SFTOptions(seq_length, loss_on_prompt, skip_invalid)
        return build_sft_datasets(sft_data, chat, options, seed, config.num_samples, config.split)
    if config.data_path:
        return _indexed_datasets(config)
    if config.lengths_file:
        lengths = lengths_from_file(config.lengths_file)
        source = f"{LENGTHS_FILE_FLAG}={config.lengths_file}"
        report_truncation(source, np.asarray(lengths.lengths), config.seq_length)
        return _mock_datasets(config, lengths)
    spec = config.distribution or DEFAULT_DISTRIBUTION
    return _mock_datasets(config, parse_length_distribution(spec))
