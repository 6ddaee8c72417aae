"""What the ``megatron-dcp`` subcommands share: argument types, the flags shared by ``simulate``
and ``benchmark``, the wording of scheduling errors in the simulator's flags, and the shape of a
subcommand that takes the whole rest of the command line (``calibrate``, ``bench-train``)."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence, Set, Tuple

from megatron_dcp.scheduling.domain import budget_multiple
from megatron_dcp.scheduling.errors import SchedulingError

# The simulator's flags for the scheduling parameters its errors name.
FLAGS = {
    "budget": "--max-seqlen-per-dp-cp-rank",
    "min_cp_size": "--min-cp-size",
    "dp_size": "--dp-size",
    "cp_size": "--cp-size",
    "vpp": "--microbatch-group-size-per-vp-stage",
    "scheduler": "--scheduler",
    "cost_model": "--cost-model",
    "hardware": "--hardware",
    "batch": "more sequences (--num-sequences, --tokens-per-global-batch)",
    "max_seqlen": "shorter sequences",
}


def error_message(error: ValueError) -> str:
    """``error`` worded with the simulator's flags."""
    return error.worded(FLAGS) if isinstance(error, SchedulingError) else str(error)


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


def add_ranks_per_node_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ranks-per-node",
        type=positive_int,
        metavar="R",
        help="GPUs per node: CP groups that span nodes pay the h100-nvlink profile's "
        "inter-node tier (InfiniBand) for their ring; the tables count them",
    )


def add_cost_profile_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cost-profile",
        metavar="PROFILE.json",
        help="plan with this cost profile (written by `megatron-dcp calibrate`) instead of "
        "--cost-model",
    )


def given_flags(argv: Sequence[str]) -> Set[str]:
    """The flag names of a pass-through command line, ``--flag value`` and ``--flag=value``
    alike: what a command that sets some flags itself refuses or leaves alone."""
    return {item.split("=", 1)[0] for item in argv if item.startswith("--")}


def add_pass_through(sub: Any, name: str, summary: str, run: Callable[[Any], int]) -> None:
    """A subcommand that takes the whole rest of the command line and parses it itself (its flags
    mix with megatron's hundreds of model flags): ``+`` as prefix, so nothing that starts with
    ``-`` is its own, and ``run(argv)`` returns the exit code."""
    p = sub.add_parser(name, help=summary, prefix_chars="+", add_help=False)
    p.add_argument("argv", nargs="*", help="the subcommand's flags and megatron's model flags")
    p.set_defaults(func=lambda args: run(args.argv))
