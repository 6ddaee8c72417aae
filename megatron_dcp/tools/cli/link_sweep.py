"""``megatron-dcp link-sweep DIR``: the report of a link-rate sweep (``scripts/bench_links.sh``):
a markdown table of every ``bench_train.json`` under DIR, the communication targets met or not,
and a picture of the speedups against FLOPs per byte of link.

    megatron-dcp link-sweep bench_out/links [--png FILE] [--flops-per-s F]

The FLOP rate is ``machine.json``'s ``flops_per_s`` in DIR (the sweep's ``gemm_rate`` at its
start) unless ``--flops-per-s`` is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_dcp.tools.argument_types import positive_int
from megatron_dcp.tools.link_sweep.runs import read_machine, read_sweep, sweep_progress
from megatron_dcp.tools.link_sweep.sweep_table import markdown_table
from megatron_dcp.tools.link_sweep.planner_targets import check_planner_targets
from megatron_dcp.tools.link_sweep.targets import check_targets

PNG_FILE = "link_sweep.png"


def add_link_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("link-sweep", help="report a link-rate sweep (scripts/bench_links.sh)")
    p.add_argument("folder", type=Path, help="the sweep's output folder, e.g. bench_out/links")
    p.add_argument("--png", type=Path, help=f"the picture (default FOLDER/{PNG_FILE})")
    p.add_argument(
        "--flops-per-s",
        type=float,
        help="one rank's FLOP rate (default: FOLDER/machine.json, written by the sweep)",
    )
    p.add_argument(
        "--progress",
        type=positive_int,
        metavar="TOTAL",
        help="print only the sweep's progress line instead: its runs done of TOTAL, their time "
        "and an estimate of what is left (the sweep prints it after each run)",
    )
    p.set_defaults(func=cmd_link_sweep)


def cmd_link_sweep(args: argparse.Namespace) -> int:
    if args.flops_per_s is not None and args.flops_per_s <= 0:
        raise ValueError(f"--flops-per-s={args.flops_per_s}: must be > 0, e.g. 1.9e11")
    if args.progress:
        print(sweep_progress(args.folder, args.progress))
        return 0
    runs = read_sweep(args.folder)
    flops = args.flops_per_s or read_machine(args.folder).get("flops_per_s")
    source = "--flops-per-s" if args.flops_per_s else "machine.json"
    print(
        f"one rank's fp32 GEMM rate: {flops / 1e9:.1f} GFLOP/s ({source})" if flops
        else "no FLOP rate (machine.json missing, no --flops-per-s): FLOPs/byte not shown"
    )
    print("\n".join(markdown_table(runs, flops)))
    print("\ncommunication targets (DCP against static CP, the model against the clock):")
    for target in check_targets(runs, flops):
        print(f"- {target.line()}")
    print("\nplanner targets (DCP against Megatron dev's planner, near the limit):")
    for target in check_planner_targets(runs):
        print(f"- {target.line()}")
    path = args.png or args.folder / PNG_FILE
    try:
        from megatron_dcp.tools.link_sweep.figure import plot_sweep

        plot_sweep(runs, flops, path)
        print(f"link-sweep: wrote {path}")
    except ImportError:
        print("link-sweep: no picture (matplotlib is missing: pip install matplotlib)")
    return 0
