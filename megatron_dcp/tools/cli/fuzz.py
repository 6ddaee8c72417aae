"""``megatron-dcp fuzz``: the plan-invariant fuzzer of :mod:`megatron_dcp.tools.plan_fuzzer` as a
subcommand (``python -m megatron_dcp.tools.plan_fuzzer`` runs it with worker processes)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from megatron_dcp.tools.argument_types import positive_int


def add_fuzz(sub: Any) -> None:
    """The ``fuzz`` subcommand."""
    p = sub.add_parser("fuzz", help="check plan invariants on random inputs")
    p.add_argument(
        "--cases", type=positive_int, default=100_000, help="random cases to plan (default 100000)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the case generator (default 0)")
    p.add_argument("--show", type=int, default=20, help="violations to print")
    p.set_defaults(func=cmd_fuzz)


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Run the plan-invariant fuzzer; exit 1 on any violation."""
    try:
        from megatron_dcp.tools.plan_fuzzer import run_fuzz
    except ImportError as error:
        print(f"megatron-dcp fuzz: the fuzzer is not available ({error}).", file=sys.stderr)
        return 2
    from megatron_dcp.tools.progress import Progress

    progress = Progress("fuzz", args.cases, "cases")
    result = run_fuzz(
        cases=args.cases,
        seed=args.seed,
        progress=lambda index, partial: progress.update(
            partial.cases, f"{partial.violation_count} violations"
        ),
    )
    stored = list(result.violations)
    # FuzzResult keeps only the first few (shrunk) violations; violation_count has the total.
    count = getattr(result, "violation_count", len(stored))
    print(f"fuzz: {result.cases} cases, {count} violations (seed {args.seed})")
    for violation in stored[: args.show]:
        print(f"  {violation}")
    if count > min(len(stored), args.show):
        print(f"  ... and {count - min(len(stored), args.show)} more")
    return 1 if count else 0
