"""``megatron-dcp sft-corpus``: write the generated conversation corpus and tokenizer of
:mod:`megatron_dcp.tools.conversation_corpus`, and print the command that trains on them."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from megatron_dcp.tools.argument_types import positive_int
from megatron_dcp.tools.conversation_corpus import (
    TRAINING_RANKS,
    data_flags,
    training_command,
    write_sft_corpus,
)


def add_sft_corpus(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("sft-corpus", help="Write a generated SFT corpus and its tokenizer.")
    parser.add_argument("--out", type=Path, required=True, help="Output directory.")
    parser.add_argument(
        "--conversations",
        type=positive_int,
        default=2000,
        metavar="N",
        help="records to write (default 2000; each holds 1 to 6 user turns)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the word chain and the lengths (the same seed writes the same corpus)",
    )
    parser.set_defaults(func=cmd_sft_corpus)


def cmd_sft_corpus(args: argparse.Namespace) -> int:
    paths = write_sft_corpus(args.out, args.conversations, args.seed)
    print(
        f"wrote {args.conversations} conversations to {paths['corpus']} and their tokenizer to "
        f"{paths['tokenizer']}"
    )
    print(f"data flags: {shlex.join(data_flags(paths))}")
    print(f"a short DCP training run on {TRAINING_RANKS} CPU ranks (runs as printed):")
    print(f"  {shlex.join(training_command(paths))}")
    return 0
