"""`megatron-dcp estimate`'s prediction against a `bench-train` run on the same data and model
(docs/estimate.md, "Against bench-train on CPU"): per arm the mean step time over the run's
compared global batches (its warm-up left out), predicted and measured, the relative error, the
forward-backward part of each and the measured step rest; then each arm's speedup over static CP,
predicted and measured.

    python scripts/compare_estimate.py BENCH_OUT/bench_train.json ESTIMATE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Dict, List, Tuple

ARMS = ("static", "dcp", "megatron_dev")


def measured_steps(bench: dict) -> Dict[str, Dict[int, Tuple[float, float]]]:
    """Per arm and compared batch: (step ms, forward-backward ms)."""
    warmup = bench["warmup"]
    steps: Dict[str, Dict[int, Tuple[float, float]]] = {}
    for step in bench["steps"]:
        if step["batch"] >= warmup:
            steps.setdefault(step["arm"], {})[step["batch"]] = (step["step_ms"], step["fwd_bwd_ms"])
    return steps


def table(bench: dict, estimate: dict) -> List[str]:
    steps = measured_steps(bench)
    rest_ms = estimate["step_rest"]["seconds"] * 1e3
    lines = [f"{'arm':14}{'pred ms':>9}{'meas ms':>9}{'error':>8}{'pred fb':>9}{'meas fb':>9}"
             f"{'meas rest':>10}"]  # fmt: skip
    means = {}
    for arm in ARMS:
        batches = sorted(steps[arm])
        per_batch = estimate["arms"][arm]["per_batch"]
        predicted = statistics.mean(per_batch[b]["step_time_s"] * 1e3 for b in batches)
        measured = statistics.mean(steps[arm][b][0] for b in batches)
        fwd_bwd = statistics.mean(steps[arm][b][1] for b in batches)
        means[arm] = (predicted, measured)
        lines.append(
            f"{arm:14}{predicted:9.1f}{measured:9.1f}{(predicted - measured) / measured:8.1%}"
            f"{predicted - rest_ms:9.1f}{fwd_bwd:9.1f}{measured - fwd_bwd:10.1f}"
        )
    for arm in ARMS[1:]:
        predicted = means["static"][0] / means[arm][0]
        measured = means["static"][1] / means[arm][1]
        lines.append(f"{arm} over static: predicted {predicted:.3f}, measured {measured:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="a bench-train run's bench_train.json")
    parser.add_argument("estimate", help="estimate --json's file for the same data and model")
    args = parser.parse_args()
    with open(args.bench) as bench, open(args.estimate) as estimate:
        print("\n".join(table(json.load(bench), json.load(estimate))))


if __name__ == "__main__":
    main()
