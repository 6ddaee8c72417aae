"""``megatron-dcp`` command line: simulate schedulers on a workload, run the reference benchmark,
fuzz the plan invariants, calibrate the cost model on the real backend, write a generated
SFT corpus, time real training steps of several planners side by side (``bench-train``), report
a sweep of such runs over link rates (``link-sweep``), replay the cost model's online refinement
on recorded runs (``replay-refinement``), check a new machine (``check``), predict whether DCP
helps on the user's data (``estimate``). ``main(argv)`` returns the exit code (0 ok, 1 fuzz
violations or a failed calibration, 2 bad input).

One module of this package per subcommand (``simulate``, ``benchmark``, ``fuzz``, ``calibrate``,
``sft_corpus``, ``bench_train``, ``link_sweep``, ``replay_refinement``, ``check``,
``estimate``), each with its ``add_*`` parser function; ``args`` holds what they share (argument
types, the wording of scheduling errors); this module assembles the parser.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_dcp.tools.cli.bench_train import add_bench_train
from megatron_dcp.tools.cli.benchmark import add_benchmark
from megatron_dcp.tools.cli.calibrate import add_calibrate
from megatron_dcp.tools.cli.check import add_check
from megatron_dcp.tools.cli.estimate import add_estimate
from megatron_dcp.tools.cli.fuzz import add_fuzz
from megatron_dcp.tools.cli.link_sweep import add_link_sweep
from megatron_dcp.tools.cli.replay_refinement import add_replay_refinement
from megatron_dcp.tools.cli.sft_corpus import add_sft_corpus
from megatron_dcp.tools.cli.simulate import add_simulate
from megatron_dcp.tools.error_wording import error_message

# ``megatron-dcp --help``'s summary of every subcommand, laid out by hand (argparse would wrap
# it and break the commands' names at their hyphens); tests/unit/test_cli_commands.py checks
# that it names each registered subcommand.
DESCRIPTION = """\
Dynamic Context Parallelism (DCP) tools, one subcommand each:
  check              a new machine: environment; static CP and DCP against a
                     float64 reference outside DCP, DCP against static CP;
                     a smoke speed figure; one verdict
  estimate           whether DCP helps on your data, before any GPU time
  simulate           the schedulers on one workload
  benchmark          the reference matrix and plan-time scaling
  fuzz               the plan invariants on random inputs
  calibrate          fit the cost model on this machine
  bench-train        time real training steps of several planners side by side
  link-sweep         report a link-rate sweep of bench-train runs
  replay-refinement  replay the cost model's online refinement on recorded runs
  sft-corpus         write a generated SFT corpus and its tokenizer
See README.md and docs/simulator.md."""


def build_parser() -> argparse.ArgumentParser:
    """The ``megatron-dcp`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="megatron-dcp",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate(sub)
    add_benchmark(sub)
    add_fuzz(sub)
    add_calibrate(sub)
    add_sft_corpus(sub)
    add_bench_train(sub)
    add_link_sweep(sub)
    add_replay_refinement(sub)
    add_check(sub)
    add_estimate(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``megatron-dcp`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"megatron-dcp {args.command}: error: {error_message(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
