"""``megatron-dcp`` command line: scheduler benchmark on the reference workloads."""

from __future__ import annotations

import argparse
import math
import random
from typing import List, Optional, Sequence

from megatron_dcp.scheduling import build_cost_model, build_scheduler
from megatron_dcp.scheduling.simulator import Report, simulate

# (dp, cp, budget, sampler) of the four reference workloads; ≈ 8 × N × budget tokens each.
REFERENCE = {
    "lognormal": (2, 4, 2048, lambda r: r.lognormvariate(math.log(1024) - 1.125, 1.5), 128, 8192),
    "rl-rollouts": (16, 4, 8192, lambda r: r.lognormvariate(math.log(4096), 0.8), 1, 32768),
    "long-sft": (
        4, 16, 16384,
        lambda r: r.uniform(32768, 262144) if r.random() < 0.01 else r.lognormvariate(math.log(1024), 1.0),
        1, 262144,
    ),
    "uniform": (4, 4, 4096, lambda r: r.uniform(1, 32768), 1, 32768),
}


def reference_lengths(name: str, seed: int = 0) -> List[int]:
    dp, cp, budget, draw, low, high = REFERENCE[name]
    rng, lengths = random.Random(seed), []
    while sum(lengths) < 8 * dp * cp * budget:
        lengths.append(int(min(high, max(low, draw(rng)))))
    return lengths


def format_row(workload: str, report: Report) -> str:
    return (
        f"{workload:<12} {report.scheduler:<19} {report.ratio:>7.4f} {report.num_microbatches:>5} "
        f"{report.max_tokens_per_rank:>9.0f} {report.mean_tokens_per_rank:>9.0f} "
        f"{report.plan_time_s * 1e3:>9.1f}  {report.cp_size_histogram}"
    )


def benchmark(cost_models: Sequence[str]) -> None:
    header = f"{'workload':<12} {'scheduler':<19} {'CP/LB':>7} {'mbs':>5} {'max tok':>9} {'mean tok':>9} {'plan ms':>9}  CP sizes"
    for cost_name in cost_models:
        print(f"\ncost model: {cost_name}\n{header}")
        for workload, (dp, cp, budget, *_rest) in REFERENCE.items():
            for name in ("default_dynamic_cp", "dp_balanced"):
                try:
                    scheduler = build_scheduler(
                        name, dp_size=dp, cp_size=cp, max_seqlen_per_dp_cp_rank=budget,
                        cost_model=build_cost_model(cost_name),
                    )
                    print(format_row(workload, simulate(scheduler, reference_lengths(workload))))
                except ValueError as error:
                    print(f"{workload:<12} {name:<19} n/a ({str(error)[:60]}...)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-dcp")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("benchmark", help="reference workloads: critical path vs lower bound")
    bench.add_argument("--cost-model", choices=["model", "attention"], action="append")
    bench.add_argument("--quick", action="store_true", help="skip the large plan-time runs")
    args = parser.parse_args(argv)
    benchmark(args.cost_model or ["model", "attention"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
