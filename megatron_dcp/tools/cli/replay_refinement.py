"""``megatron-dcp replay-refinement DIR [DIR ...]``: the online refinement of recorded
``bench-train`` runs, replayed offline (``tools.refinement.replay``).

One folder and one variant: every iteration's predicted step time (and the ``[DCP]`` line's, to
check the replay) against the measured one, with the refined factors (``*``: at a bound). Several
folders or variants: the median model error over iterations 5–30 of each run under each variant.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_dcp.tools.refinement.replay import VARIANTS


def add_replay_refinement(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay-refinement",
        help="replay the cost-model refinement of recorded bench-train runs (docs/cost_model.md)",
        description="Feed the refinement the steps a bench-train run recorded (times.jsonl, "
        "plans.jsonl), as the run did, and print its predictions against the measured times.",
    )
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="bench-train --out folders")
    p.add_argument(
        "--variants",
        default="current",
        help=f"comma-separated refinement variants, from {', '.join(VARIANTS)} (default current)",
    )
    p.add_argument(
        "--hardware",
        default="cpu-gloo",
        help="hardware profile of runs that wrote no prior.json and name none (default cpu-gloo)",
    )
    p.add_argument(
        "--link-bandwidth",
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="replay from the prior --dcp-link-bandwidth would have given the runs (their "
        "flags' cost model with this link rate) instead of the prior they ran with",
    )
    p.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    from megatron_dcp.tools.refinement.replay import (
        load_run,
        parse_variants,
        replay,
        step_table,
        summary_table,
        replay_errors,
    )

    variants = parse_variants(args.variants)
    missing = [str(d) for d in args.dirs if not (d / "times.jsonl").exists()]
    if missing:
        raise ValueError(
            f"{', '.join(missing)}: no times.jsonl; give bench-train --out folders of finished "
            "runs."
        )
    runs = [load_run(d, args.hardware, args.link_bandwidth) for d in args.dirs]
    if len(runs) == 1 and len(variants) == 1:
        steps = replay(runs[0], variants[0])
        print(step_table(steps))
        errors = ", ".join(f"{k}: {v * 100:.1f} %" for k, v in replay_errors(steps).items())
        print(f"median |pred - meas| / meas ({variants[0].name}): {errors}")
    else:
        print(summary_table(runs, variants))
    return 0
