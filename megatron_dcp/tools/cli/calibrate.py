"""``megatron-dcp calibrate``: its flags (mixed with megatron's model flags), their checks, and
the whole command: check, measure, fit, write, print (:mod:`megatron_dcp.tools.calibration.fit`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from typing import Any, Sequence

from megatron_dcp.scheduling.cost_fit import CostProfile, save_profile
from megatron_dcp.tools.argument_types import fraction, int_list, positive_int
from megatron_dcp.tools.calibration.fit import (
    DEFAULT_HOLD_OUT,
    DEFAULT_LENGTHS,
    DEFAULT_PACK_SIZES,
    DEFAULT_REPEATS,
    PROG,
    cache_size,
    check_split,
    fit_points,
    grid,
    report,
    run_measurement,
    source,
    split_hold_out,
)
from megatron_dcp.tools.calibration.shaped_link import (
    describe_link,
    link_source,
    shaped_calibration,
)
from megatron_dcp.tools.cli.args import add_pass_through
from megatron_dcp.tools.launching.training_runs import available_cores, check_rank_per_core

USAGE = f"{PROG} --output PROFILE.json [calibration flags] (megatron's model flags)"


def add_calibrate(sub: Any) -> None:
    """The ``calibrate`` subcommand: the rest of the command line goes to :func:`calibrate`."""
    summary = "measure the model on this machine and fit a cost profile (--dcp-cost-profile)"
    add_pass_through(sub, "calibrate", summary, calibrate)


def add_calibration_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The calibration flags (on the small parser and on megatron's)."""
    g = parser.add_argument_group("calibration (megatron-dcp calibrate)")
    g.add_argument("--output", required=True, metavar="PROFILE.json", help="the profile to write")
    lengths, nproc = ",".join(map(str, DEFAULT_LENGTHS)), min(2, available_cores())
    flags = (
        ("--nproc", positive_int, nproc, "ranks, one core and thread each (default min(2, cores))"),
        ("--lengths", int_list, None, f"sequence lengths (default {lengths} up to --seq-length)"),
        ("--pack-sizes", int_list, DEFAULT_PACK_SIZES, "sequences per micro-batch (default 1,2,4)"),
        ("--max-tokens", positive_int, None, "most tokens one point packs (default --seq-length)"),
        ("--repeats", positive_int, DEFAULT_REPEATS, "timed passes after one warm-up (default 3)"),
        ("--hold-out", fraction, DEFAULT_HOLD_OUT, "held-out share per CP size (default 0.25)"),
        ("--timeout", positive_int, 1800, "seconds before the ranks are stopped (default 1800)"),
    )
    for name, kind, default, text in flags:
        g.add_argument(name, type=kind, default=default, help=text)
    g.add_argument(
        "--link-rate",
        default=None,
        metavar="RATE",
        help="calibrate inside a network namespace whose loopback tbf shapes to RATE (tc units, "
        "e.g. 200mbit; root): the comm term at that link (docs/cost_model.md)",
    )
    return parser


def calibration_parser() -> argparse.ArgumentParser:
    """The calibration flags alone (checked before megatron is imported)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=USAGE,
        description="Measure the real model on this machine and fit the cost model the "
        "scheduler plans with (module megatron_dcp.tools.calibration.fit).",
        epilog="Model flags: those of `python -m megatron_dcp.pretrain_gpt --help`.",
        allow_abbrev=False,
        add_help=False,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    return add_calibration_args(parser)


def check_options(options: argparse.Namespace) -> None:
    """ValueErrors naming the flag, before anything starts."""
    check_rank_per_core(options.nproc, "Use --nproc {cores} or fewer.")
    folder = os.path.dirname(os.path.abspath(options.output))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(
            f"--output={options.output}: cannot write into {folder} (missing or read-only); "
            "create the folder or choose another path."
        )


def parse_model_args(argv: Sequence[str]) -> argparse.Namespace:
    """megatron's arguments (with the DCP and calibration flags) as ``pretrain_gpt`` parses them
    on CPU, validated, without megatron's global state; argument dump silenced."""
    from megatron_dcp import pretrain_gpt  # first: it makes megatron importable on CPU

    from megatron.training.arguments import parse_args, validate_args  # isort: skip

    if not pretrain_gpt.ON_CPU:
        raise ValueError(
            "calibrate measures the CPU backend (gloo ranks) but CUDA is visible; run it with "
            "CUDA_VISIBLE_DEVICES= (GPU calibration is not supported yet)."
        )

    def provide(parser: argparse.ArgumentParser) -> Any:
        add_calibration_args(parser)
        parser.set_defaults(tokenizer_type="NullTokenizer", micro_batch_size=1)
        parser.prog, parser.usage = PROG, USAGE
        return pretrain_gpt.extra_args(list(argv))(parser)

    dump = io.StringIO()
    try:
        with contextlib.redirect_stdout(dump):
            args = parse_args(provide)
            validate_args(args)
    except AssertionError as error:
        raise ValueError(f"megatron rejects the model flags: {error}") from None
    if args.vocab_size is None:
        raise ValueError("--vocab-size is required (calibrate builds no tokenizer)")
    return args


def calibrate(argv: Sequence[str]) -> int:
    """The whole command: check, measure, fit, write, print. Returns the exit code."""
    parser = calibration_parser()
    if {"-h", "--help"} & set(argv):
        parser.print_help()
        return 0
    options, model_flags = parser.parse_known_args(list(argv))
    check_options(options)
    if options.link_rate is not None:
        return shaped_calibration(argv, options)
    args = parse_model_args(argv)
    spill_elements, hardware = cache_size(args)
    points = grid(options, args.seq_length, spill_elements)
    held = split_hold_out(points, options.hold_out, args.seed)
    check_split(held, options.hold_out)
    measured = run_measurement(points, options, args)
    if measured is None:
        return 1
    result = fit_points(points, measured, held)
    described = source(result, options, args, model_flags)
    described["spill_threshold_from"] = hardware
    link = link_source(result.cost, args, options.nproc)
    if link is not None:
        described["link"] = link
    save_profile(options.output, CostProfile(result.cost, described))
    print("\n".join(report(result)))
    if link is not None:
        print(describe_link(link))
    from megatron_dcp.integration.config import COST_PROFILE_FLAG

    print(f"profile written to {options.output}; train with {COST_PROFILE_FLAG} {options.output}")
    return 0
