"""The sequence lengths of the first global batches of the user's data, as training would read
them: exactly one source, each sample's length ``L`` at most ``--seq-length``.

- ``--data-path``, ``--sft-data``, ``--varlen-distribution``, ``--varlen-lengths-file``: the
  training entry point's own datasets (``integration.data.datasets.build_varlen_datasets``,
  as ``quickstart`` reads them): one document or conversation per sample, truncated, the
  documents of ``--split``'s train range in the seeded order of training (needs torch and
  megatron-core);
- ``--lengths FILE`` (``simulate --lengths``'s format): the samples in the file's order, cycled
  and truncated as ``--varlen-lengths-file`` is (no torch);
- ``--hf-dataset NAME --text-field F`` (``json``/``parquet`` with ``--data-files``): the rows in
  a seeded order, each text's tokens with ``--tokenizer-model``, else its whitespace-separated
  words (the output says which); needs the ``datasets`` package.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

from megatron_dcp.tools.workloads import read_lengths

TRAINING_SOURCES = ("--data-path", "--sft-data", "--varlen-distribution", "--varlen-lengths-file")
SOURCES = ("--lengths", "--hf-dataset", *TRAINING_SOURCES)
CHAT_TOKENIZER = "HuggingFaceTokenizer"


@dataclass
class Samples:
    """The samples' lengths in training's order, where they came from, and what to know."""

    lengths: List[int]
    source: str
    notes: List[str] = field(default_factory=list)


def attribute(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def given_value(args: argparse.Namespace, flag: str) -> Any:
    value = getattr(args, attribute(flag), None)
    return " ".join(value) if isinstance(value, list) else value


def chosen_source(args: argparse.Namespace) -> str:
    """The one data-source flag given; ValueError for none or several."""
    given = [flag for flag in SOURCES if getattr(args, attribute(flag), None)]
    if not given:
        raise ValueError(
            "no data source: give one of --data-path PREFIX (a megatron indexed dataset), "
            "--sft-data FILE (conversations, with --tokenizer-model DIR), --hf-dataset NAME "
            "--text-field F, or --lengths FILE (one sequence length a line)."
        )
    if len(given) > 1:
        named = " and ".join(f"{flag}={given_value(args, flag)!r}" for flag in given)
        raise ValueError(f"{named}: give exactly one data source; remove the others.")
    return given[0]


def read_samples(args: argparse.Namespace, count: int) -> Samples:
    """The lengths of the first ``count`` samples of the chosen source."""
    flag = chosen_source(args)
    readers: Dict[str, Callable[[argparse.Namespace, int], Samples]] = {
        "--lengths": lengths_file_samples,
        "--hf-dataset": hf_samples,
    }
    reader = readers.get(flag, training_samples)
    return reader(args, count)


def truncated(lengths: List[int], seq_length: int) -> List[int]:
    return [min(length, seq_length) for length in lengths]


def truncation_note(raw: List[int], seq_length: int) -> List[str]:
    over = sum(1 for length in raw if length > seq_length)
    if not over:
        return []
    return [f"{over} of {len(raw)} samples are longer than --seq-length {seq_length}: "
            "truncated to it, as training does"]  # fmt: skip


def lengths_file_samples(args: argparse.Namespace, count: int) -> Samples:
    """``--lengths FILE``: sample ``i`` has the file's length ``i mod n`` (cycled)."""
    file = read_lengths(args.lengths)
    raw = [file[index % len(file)] for index in range(count)]
    source = f"--lengths {args.lengths} ({len(file)} lengths, in order, cycled)"
    notes = truncation_note(raw, args.seq_length)
    return Samples(truncated(raw, args.seq_length), source, notes)


def check_tokenizer(args: argparse.Namespace) -> None:
    """``--sft-data`` renders conversations with a saved HuggingFace tokenizer's chat template."""
    if args.tokenizer_type not in (None, CHAT_TOKENIZER):
        raise ValueError(
            f"--tokenizer-type={args.tokenizer_type}: estimate reads conversations with a saved "
            f"HuggingFace tokenizer; pass --tokenizer-type {CHAT_TOKENIZER} --tokenizer-model DIR."
        )
    if not args.tokenizer_model:
        raise ValueError(
            f"--sft-data={args.sft_data}: conversations are measured in the tokens of their chat "
            "template; add --tokenizer-model DIR (a saved HuggingFace tokenizer with a chat "
            f"template, as training's --tokenizer-type {CHAT_TOKENIZER} takes)."
        )


def training_samples(args: argparse.Namespace, count: int) -> Samples:
    """The training entry point's train dataset of ``count`` samples, as training builds it."""
    if args.sft_data:
        check_tokenizer(args)
    from megatron_dcp.integration.data.chat import chat_tokenizer_from_dir
    from megatron_dcp.integration.data.datasets import build_varlen_datasets

    chat = chat_tokenizer_from_dir(args.tokenizer_model) if args.sft_data else None
    train, _, _ = build_varlen_datasets(
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        seed=args.seed,
        num_samples=[count, 0, 0],
        distribution=args.varlen_distribution,
        lengths_file=args.varlen_lengths_file,
        data_path=args.data_path,
        split=args.split,
        sft_data=args.sft_data,
        chat=chat,
    )
    flag = next(flag for flag in TRAINING_SOURCES if getattr(args, attribute(flag)))
    source = f"{flag} {given_value(args, flag)} (training's train split, seed {args.seed})"
    return Samples([train.sequence_length(index) for index in range(count)], source)


def hf_samples(args: argparse.Namespace, count: int) -> Samples:
    """``--hf-dataset``: the rows in a seeded order (passes repeat), each text's token count."""
    rows = load_hf_rows(args)
    count_tokens, unit = token_counter(args)
    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)
    raw: List[int] = []
    for position in range(count * len(order)):  # empty texts are skipped
        if len(raw) == count or (position == len(order) and not raw):
            break
        tokens = count_tokens(str(rows[order[position % len(order)]][args.text_field]))
        if tokens > 0:
            raw.append(tokens)
    if not raw:
        raise ValueError(f"--text-field={args.text_field}: every text of the dataset is empty.")
    source = f"--hf-dataset {args.hf_dataset} ({len(rows)} rows, seed {args.seed}; {unit})"
    return Samples(truncated(raw, args.seq_length), source, truncation_note(raw, args.seq_length))


def load_hf_rows(args: argparse.Namespace) -> Any:
    """The split of the Hugging Face dataset, checked for ``--text-field``."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"--hf-dataset={args.hf_dataset}: the Hugging Face `datasets` package is not "
            "installed; pip install datasets (or write the lengths to a file and pass --lengths)."
        ) from None
    if not args.text_field:
        raise ValueError(f"--hf-dataset={args.hf_dataset}: add --text-field F, the column of text.")
    files = {"data_files": args.data_files} if args.data_files else {}
    rows = datasets.load_dataset(args.hf_dataset, split=args.hf_split, **files)
    if args.text_field not in rows.column_names:
        raise ValueError(
            f"--text-field={args.text_field}: no such column in {args.hf_dataset}; its columns "
            f"are {', '.join(rows.column_names)}."
        )
    if len(rows) == 0:
        raise ValueError(f"--hf-dataset={args.hf_dataset}: split {args.hf_split!r} has no rows.")
    return rows


def token_counter(args: argparse.Namespace) -> "tuple[Callable[[str], int], str]":
    """Tokens of a text with ``--tokenizer-model``, else whitespace-separated words; and which."""
    if not args.tokenizer_model:
        return (lambda text: len(text.split())), (
            "no --tokenizer-model: tokens counted as whitespace-separated words, fewer than a "
            "subword tokenizer makes"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_model)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return count, f"tokens of {args.tokenizer_model}"
