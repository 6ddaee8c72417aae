"""``megatron-dcp benchmark``: the target matrix and the plan-time runs of
:mod:`megatron_dcp.tools.benchmark_matrix`, as a subcommand."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_dcp.scheduling.cost import COST_MODELS
from megatron_dcp.tools.argument_types import positive_int, training_budget
from megatron_dcp.tools.benchmark_matrix import (
    DEFAULT_BUDGETS,
    DEFAULT_COST_MODELS,
    DEFAULT_MAX_TIMING_N,
    benchmark_comparisons,
    benchmark_timings,
    format_timings,
)
from megatron_dcp.tools.cli.args import add_cost_profile_arg, add_ranks_per_node_arg


def cmd_benchmark(args: argparse.Namespace) -> int:
    """Reference workloads (tables printed as they finish), then the plan-time runs."""
    comparisons = benchmark_comparisons(args)
    timings = [] if args.no_timing else benchmark_timings(args)
    if args.json:
        data = {
            "workloads": [c.as_dict() for c in comparisons],
            "plan_time": [t.__dict__ for t in timings],
        }
        print(json.dumps(data, indent=2))
    elif timings:
        print(format_timings(timings))
    return 0


def add_benchmark(sub: Any) -> None:
    """The ``benchmark`` subcommand."""
    p = sub.add_parser("benchmark", help="the target matrix and plan-time scaling")
    p.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        action="append",
        help=f"restrict to this cost model (repeatable; default {', '.join(DEFAULT_COST_MODELS)})",
    )
    add_cost_profile_arg(p)
    p.add_argument(
        "--workload",
        action="append",
        metavar="NAME",
        help="restrict to these workloads (repeatable; name or 1-4)",
    )
    p.add_argument(
        "--budget",
        type=training_budget,
        action="append",
        metavar="TOKENS",
        help=f"per-rank budgets (repeatable; default {' '.join(map(str, DEFAULT_BUDGETS))})",
    )
    p.add_argument(
        "--vpp",
        type=positive_int,
        action="append",
        metavar="K",
        help="VPP micro-batch group sizes, 1 = no VPP (repeatable; default 1 2 4)",
    )
    add_ranks_per_node_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the length sampler (default 0)")
    p.add_argument("--quick", action="store_true", help="plan-time runs at N=64 only")
    p.add_argument(
        "--max-timing-n",
        type=positive_int,
        default=DEFAULT_MAX_TIMING_N,
        metavar="N",
        help="plan-time runs up to this domain size (of 64 1024 4096 16384; default "
        f"{DEFAULT_MAX_TIMING_N}; the N=16384 row takes about a minute on 2 cores)",
    )
    p.add_argument("--no-timing", action="store_true", help="skip the plan-time runs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_benchmark)
