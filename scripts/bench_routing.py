#!/usr/bin/env python
"""Benchmark sample routing: all-to-all to the ranks of each CP group vs all-gather of the batch.

Per world size, one table with a row per rank: samples it computes, MB received and sent by
``route_samples`` (all-to-all over the DP×CP domain) and by ``route_by_lane_all_gather`` (every rank
gets the whole batch over DP), and the median time of each. Lognormal lengths, the plan from
``default_dynamic_cp``, samples of four fields (tokens, labels, position_ids int64; loss_mask
float32: 28 bytes per token). Gloo on CPU via fork-started workers: the byte counts are exact,
the times only indicative (all workers share this machine's cores).

    python scripts/bench_routing.py [--worlds 4 8] [--samples-per-dp-rank 16] [--iters 5]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_dcp.runtime.exchange import GlobalLengths
from megatron_dcp.runtime.routing import (
    RoutedSamples,
    SampleSchema,
    route_by_lane_all_gather,
    route_samples,
)
from megatron_dcp.scheduling import Plan, build_scheduler
from megatron_dcp.testing import run_distributed

CP_SIZE = {4: 2, 8: 2, 16: 4}
MB = 1024 * 1024


@dataclass(frozen=True)
class Workload:
    """One global batch: lognormal lengths, the same number of samples on every DP rank."""

    dp_size: int
    cp_size: int
    samples_per_dp_rank: int
    median: float
    sigma: float
    budget: int
    seed: int

    def plan(self) -> Plan:
        rng = random.Random(self.seed)
        longest = self.dp_size * self.cp_size * self.budget
        count = self.dp_size * self.samples_per_dp_rank
        seqlens = [
            min(longest, max(1, round(rng.lognormvariate(_mu(self.median), self.sigma))))
            for _ in range(count)
        ]
        scheduler = build_scheduler(
            "default_dynamic_cp",
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            max_seqlen_per_dp_cp_rank=self.budget,
        )
        return scheduler.schedule(seqlens)


@dataclass(frozen=True)
class RankResult:
    """What one rank measured for both routing methods."""

    position: int
    samples: int
    alltoall_received: int
    alltoall_sent: int
    alltoall_s: float
    allgather_received: int
    allgather_s: float


def _mu(median: float) -> float:
    return math.log(median)


def _sample(sample_id: int, length: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 32000, (length,), generator=torch.Generator().manual_seed(sample_id))
    return {
        "tokens": tokens,
        "labels": tokens.roll(-1),
        "loss_mask": torch.ones(length, dtype=torch.float32),
        "position_ids": torch.arange(length, dtype=torch.int64),
    }


def _median_time(call: Callable[[], RoutedSamples], iters: int) -> tuple[RoutedSamples, float]:
    """Median wall time of ``call`` over ``iters`` runs, each started after a barrier."""
    times = []
    for _ in range(iters + 1):  # the first run warms up gloo's connections
        dist.barrier()
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times[1:])


def _worker(rank: int, world_size: int, workload: Workload, iters: int) -> RankResult:
    plan = workload.plan()
    cp = workload.cp_size
    counts = (workload.samples_per_dp_rank,) * workload.dp_size
    lengths = GlobalLengths(plan.seqlens, counts)
    local = {i: _sample(i, plan.seqlens[i]) for i in lengths.ids_of(rank // cp)}
    schema = SampleSchema.of(next(iter(local.values())))
    dp_groups = [dist.new_group(list(range(c, world_size, cp))) for c in range(cp)]
    alltoall, alltoall_s = _median_time(
        lambda: route_samples(plan, local, rank, None, lengths.owner_of, schema=schema), iters
    )
    allgather, allgather_s = _median_time(
        lambda: route_by_lane_all_gather(
            plan, local, rank, dp_groups[rank % cp], lengths.owner_of, schema=schema
        ),
        iters,
    )
    return RankResult(
        position=rank,
        samples=len(alltoall.samples),
        alltoall_received=alltoall.bytes_received,
        alltoall_sent=alltoall.bytes_sent,
        alltoall_s=alltoall_s,
        allgather_received=allgather.bytes_received,
        allgather_s=allgather_s,
    )


def _table(workload: Workload, plan: Plan, results: list[RankResult]) -> str:
    head = (
        f"world {len(results)} (dp {workload.dp_size} x cp {workload.cp_size}), "
        f"{len(plan.seqlens)} samples, {sum(plan.seqlens)} tokens, "
        f"{plan.num_microbatches} micro-batches, CP sizes {plan.cp_size_histogram()}"
    )
    lines = [
        head,
        f"{'pos':>3} {'samples':>7} | {'a2a recv MB':>11} {'a2a sent MB':>11} {'a2a ms':>7} | "
        f"{'allgather recv MB':>17} {'allgather ms':>12}",
    ]
    for r in results:
        lines.append(
            f"{r.position:>3} {r.samples:>7} | {r.alltoall_received / MB:>11.2f} "
            f"{r.alltoall_sent / MB:>11.2f} {r.alltoall_s * 1e3:>7.1f} | "
            f"{r.allgather_received / MB:>17.2f} {r.allgather_s * 1e3:>12.1f}"
        )
    lines.append(_totals(results))
    return "\n".join(lines)


def _totals(results: list[RankResult]) -> str:
    a2a = sum(r.alltoall_received for r in results) / MB
    gather = sum(r.allgather_received for r in results) / MB
    a2a_ms = max(r.alltoall_s for r in results) * 1e3
    gather_ms = max(r.allgather_s for r in results) * 1e3
    return (
        f"all {'':>7} | {a2a:>11.2f} {'':>11} {a2a_ms:>7.1f} | {gather:>17.2f} {gather_ms:>12.1f}"
        f"   (received: all-to-all = {a2a / gather:.0%} of all-gather; ms = slowest rank)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], choices=sorted(CP_SIZE))
    parser.add_argument("--samples-per-dp-rank", type=int, default=16)
    parser.add_argument("--median", type=float, default=1024)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--budget", type=int, default=4096, help="max_seqlen_per_dp_cp_rank")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for world in args.worlds:
        cp = CP_SIZE[world]
        workload = Workload(
            world // cp,
            cp,
            args.samples_per_dp_rank,
            args.median,
            args.sigma,
            args.budget,
            args.seed,
        )
        results = run_distributed(_worker, world, workload, args.iters, timeout_s=600)
        print(_table(workload, workload.plan(), results), end="\n\n")


if __name__ == "__main__":
    main()
