"""``megatron-dcp`` command line: simulate schedulers on a workload, run the reference benchmark,
fuzz the plan invariants, calibrate the cost model on the real backend, write a generated
SFT corpus, time real training steps of several planners side by side (``bench-train``).
``main(argv)`` returns
the exit code (0 ok, 1 fuzz violations or a failed calibration, 2 bad input).

One module per subcommand (``simulate``, ``benchmark``, ``fuzz``, ``calibrate``, ``sft_corpus``,
``bench_train.command``), each with its ``add_*`` parser
function and ``cmd_*``; this module assembles the parser and holds what they share: the argument
types and the wording of scheduling errors in the simulator's flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

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


def build_parser() -> argparse.ArgumentParser:
    """The ``megatron-dcp`` argument parser with its subcommands."""
    # Imported here: the subcommand modules import this module's argument types and wording.
    from megatron_dcp.tools.bench_train.command import add_bench_train
    from megatron_dcp.tools.benchmark import add_benchmark
    from megatron_dcp.tools.calibrate import add_calibrate
    from megatron_dcp.tools.fuzz_command import add_fuzz
    from megatron_dcp.tools.sft_corpus import add_sft_corpus
    from megatron_dcp.tools.simulate import add_simulate

    parser = argparse.ArgumentParser(
        prog="megatron-dcp",
        description="Dynamic Context Parallelism scheduling tools: simulate schedulers on a "
        "workload, run the reference benchmark, fuzz the plan invariants. See docs/simulator.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate(sub)
    add_benchmark(sub)
    add_fuzz(sub)
    add_calibrate(sub)
    add_sft_corpus(sub)
    add_bench_train(sub)
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
