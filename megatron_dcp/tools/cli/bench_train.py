"""``megatron-dcp bench-train``: time real training steps of several planners on identical
global batches, one rank per core.

    megatron-dcp bench-train [--nproc 2] [--arms static,dcp,megatron_dev] [--batches 14] \\
        [--warmup 2] [--out bench_train_out] [--entry pretrain_gpt] [--oversubscribe] \\
        [--link-rate 200mbit [--nodes 2]] \\
        [megatron and DCP flags, e.g. --varlen-distribution ... --max-seqlen-per-dp-cp-rank ...]

One training run (:mod:`~megatron_dcp.tools.bench_train.run`) runs every global batch once per
arm, the arms taking turns in a rotating order, so that both arms of a comparison run the same
samples on the same warm process within seconds of each other. Flags not given take
``DEFAULTS`` (``bench_train/run_flags.py``: a 4-layer, hidden-256 GPT, 32 sequences per global
batch, DP 1 × CP ``--nproc``). The first ``--warmup`` batches are left out; what is left is
compared batch by batch (``stats``). ``--link-rate`` runs it all inside a fresh network
namespace whose loopback is shaped to the rate, ``--nodes 2`` on two namespaces joined by a
shaped veth (``tools.link``, root only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from megatron_dcp.tools.argument_types import positive_int
from megatron_dcp.tools.bench_train.arms import DEFAULT_ARMS, parse_arms, runnable
from megatron_dcp.tools.bench_train.run import check_cores, link_spec, run_bench
from megatron_dcp.tools.cli.args import add_pass_through
from megatron_dcp.tools.launching.training_runs import TrainingRunError

PROG = "megatron-dcp bench-train"
ENTRIES = ("pretrain_gpt", "pretrain_mamba", "pretrain_vlm")


def bench_parser() -> argparse.ArgumentParser:
    """The benchmark's own flags; every other flag goes to the training entry point."""
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [benchmark flags] [megatron and DCP flags]",
        description="Time real training steps of several planners on identical global batches.",
        epilog="Other flags: those of `python -m megatron_dcp.pretrain_gpt --help`.",
        allow_abbrev=False,
    )
    p.add_argument("--nproc", type=positive_int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--arms",
        type=parse_arms,
        default=DEFAULT_ARMS,
        help=f"comma-separated arms, static first (default {','.join(DEFAULT_ARMS)})",
    )
    p.add_argument(
        "--batches", type=positive_int, default=14, help="global batches, warm-up included"
    )
    p.add_argument("--warmup", type=int, default=2, help="first batches left out (default 2)")
    p.add_argument("--out", type=Path, default=Path("bench_train_out"), help="output folder")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile every arm's step of the first N compared batches with torch.profiler and "
        "print where the busiest rank's time goes (default 0: off; docs/performance.md)",
    )
    p.add_argument("--entry", choices=ENTRIES, default="pretrain_gpt", help="training entry point")
    p.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more ranks than cores (the figures then time the OS scheduler too)",
    )
    p.add_argument(
        "--link-rate",
        help="run inside a fresh network namespace whose links are shaped to this rate, in "
        "tc's units (200mbit = 25 MB/s; 25mbps is bytes/s); root only",
    )
    p.add_argument(
        "--nodes",
        type=positive_int,
        default=1,
        help="with --link-rate: 2 splits the ranks over two namespaces joined by a veth, only "
        "the veth shaped",
    )
    return p


def add_bench_train(sub: argparse._SubParsersAction) -> None:
    """The ``bench-train`` subcommand: the rest of the command line goes to :func:`bench_train`."""
    summary = "time training steps of several planners side by side (docs/performance.md)"
    add_pass_through(sub, "bench-train", summary, bench_train)


def bench_train(argv: Sequence[str]) -> int:
    """The whole command: check, run, check fairness, report. Returns the exit code."""
    from megatron_dcp.tools.bench_train.profile_report import print_attribution
    from megatron_dcp.tools.bench_train.report import print_report, write_outputs

    options, extra = bench_parser().parse_known_args(list(argv))
    check_cores(options.nproc, options.oversubscribe)
    if not 0 <= options.warmup < options.batches:
        raise ValueError(
            f"--warmup={options.warmup}: must leave batches to compare (0 ≤ warmup < --batches="
            f"{options.batches})."
        )
    if not 0 <= options.profile <= options.batches - options.warmup:
        raise ValueError(
            f"--profile={options.profile}: profiles the first N compared batches, so 0 ≤ N ≤ "
            f"--batches − --warmup = {options.batches - options.warmup}."
        )
    link = link_spec(options, extra)
    arms, missing = runnable(options.arms)
    try:
        result = run_bench(options, arms, extra, link)
    except TrainingRunError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    result.unavailable.update(missing)
    print_report(result)
    write_outputs(result, options.out)
    print_attribution(options.out)
    return 0
