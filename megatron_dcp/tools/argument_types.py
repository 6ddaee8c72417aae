"""What the tools' command lines share below the parser: argparse types (an integer ≥ 1, a power
of two, a training budget, a list of integers, a fraction) and the flag names a pass-through
command line gives."""

from __future__ import annotations

import argparse
from typing import Sequence, Set, Tuple

from megatron_dcp.scheduling.domain import budget_multiple


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 1")
    return value


def power_of_two(text: str) -> int:
    """argparse type: 1, 2, 4, ..."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two (use 1, 2, 4, ...)")
    return value


def training_budget(text: str) -> int:
    """argparse type: a per-rank token budget that training accepts (pretrain_gpt and the RL
    adapter refuse one that is not a multiple of :func:`budget_multiple`)."""
    value = positive_int(text)
    multiple = budget_multiple()
    if value % multiple:
        below, above = value - value % multiple, value - value % multiple + multiple
        raise argparse.ArgumentTypeError(
            f"{value} is not a multiple of {multiple}: training (pretrain_gpt, the RL adapter) "
            f"refuses it, as every sequence is padded to {multiple} × CP size; use "
            + (f"{below} or {above}" if below else f"{above}")
        )
    return value


def int_list(text: str) -> Tuple[int, ...]:
    """argparse type: ``128,256,512`` (positive integers, comma-separated)."""
    values = tuple(positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one value, e.g. 1,2,4")
    return values


def fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{value} must lie strictly between 0 and 1")
    return value


def given_flags(argv: Sequence[str]) -> Set[str]:
    """The flag names of a pass-through command line, ``--flag value`` and ``--flag=value``
    alike: what a command that sets some flags itself refuses or leaves alone."""
    return {item.split("=", 1)[0] for item in argv if item.startswith("--")}
