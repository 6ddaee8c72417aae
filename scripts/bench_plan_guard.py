#!/usr/bin/env python
"""Benchmark the plan-consistency guard (``runtime.plan_guard``): the plan digest in one process,
and the whole guard (digest + one all-reduce of two int64 over the domain) on 8 gloo ranks.

Plans of workload-1 lengths (16 per rank, dp N/4 × cp 4, the budget of ``megatron-dcp
benchmark``'s plan-time table) for N = 64, 1024, 4096. The guard's time is the median over 200
calls after a barrier; with 8 processes on a 2-core machine it is dominated by process
scheduling, not by the 16 bytes it reduces.

    python scripts/bench_plan_guard.py
"""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from megatron_dcp.runtime.plan_guard import check_same_plan
from megatron_dcp.scheduling import Plan, build_scheduler
from megatron_dcp.testing import run_distributed
from megatron_dcp.tools.benchmark_matrix import timing_lengths

DOMAINS = (64, 1024, 4096)
WORLD = 8


def plan_of(domain_size: int) -> Plan:
    lengths, budget = timing_lengths(16 * domain_size, domain_size // 4, 4, seed=0)
    return build_scheduler(
        "default_dynamic_cp",
        dp_size=domain_size // 4,
        cp_size=4,
        max_seqlen_per_dp_cp_rank=budget,
        min_cp_size=1,
    ).schedule(lengths)


def digest_ms(plan: Plan, repeats: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        plan.digest()
    return (time.perf_counter() - start) / repeats * 1e3


def guard_us(rank: int, world_size: int, domain_size: int) -> float:
    plan = plan_of(domain_size)
    times = []
    for _ in range(200):
        dist.barrier()
        start = time.perf_counter()
        check_same_plan(plan, None, step=1)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    print(f"{'N':>5} {'sequences':>9} {'groups':>7} {'digest ms':>9} {'guard us (8 ranks)':>18}")
    for n in DOMAINS:
        plan = plan_of(n)
        groups = sum(len(mb.groups) for mb in plan.microbatches)
        guard = statistics.median(run_distributed(guard_us, WORLD, n, timeout_s=600))
        print(f"{n:>5} {len(plan.seqlens):>9} {groups:>7} {digest_ms(plan):>9.2f} {guard:>18.0f}")


if __name__ == "__main__":
    main()
