"""What the ``megatron-dcp`` subcommands' parsers share: the flags shared by ``simulate`` and
``benchmark``, and the shape of a subcommand that takes the whole rest of the command line
(``calibrate``, ``bench-train``). The argument types are :mod:`megatron_dcp.tools.argument_types`,
the wording of scheduling errors :mod:`megatron_dcp.tools.error_wording`."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from megatron_dcp.tools.argument_types import positive_int


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


def add_pass_through(sub: Any, name: str, summary: str, run: Callable[[Any], int]) -> None:
    """A subcommand that takes the whole rest of the command line and parses it itself (its flags
    mix with megatron's hundreds of model flags): ``+`` as prefix, so nothing that starts with
    ``-`` is its own, and ``run(argv)`` returns the exit code."""
    p = sub.add_parser(name, help=summary, prefix_chars="+", add_help=False)
    p.add_argument("argv", nargs="*", help="the subcommand's flags and megatron's model flags")
    p.set_defaults(func=lambda args: run(args.argv))
