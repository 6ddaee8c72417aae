#!/usr/bin/env python
"""Benchmark the two sample routings (``--dcp-routing``): all-to-all over the DP×CP domain
against all-gather inside each CP lane (the ranks at one CP rank across the DP replicas).

Two parts:

1. **Measured** at N = 8 (gloo, fork-started workers on this machine): per rank, the bytes each
   routing received (the sizes of the buffers the collective filled) and the samples it kept;
   then the time of both, *paired*: ``--pairs`` rounds per job, each round runs both (order
   alternating), each time the slowest rank's (a MAX all-reduce after the call), and ``--jobs``
   separate jobs. Reported: medians with bootstrap intervals and Σ lane / Σ all-to-all over the
   rounds with its interval (``tools.bench_train.stats``).
2. **Computed** for N = 8, 64, 512, 4,096 from the plans alone (``runtime.routing_volume``,
   whose N = 8 figures equal the measured ones): bytes received per rank, the ranks each rank
   exchanges with directly (peers) in one global batch and over ``--batches`` batches (NCCL keeps
   a connection once made, so the union is what its buffers follow), the lane's gather buffer.

Workload: lognormal lengths (median 1024, σ 1), ``--samples-per-dp-rank`` per DP rank, dp = N /
``--cp``, budget 4096, plans from ``default_dynamic_cp``; samples of three fields (tokens and
labels int64, loss_mask float32: 20 bytes per token, what ``DCPForwardBackward`` routes).

    python scripts/bench_routing.py [--cp 2] [--pairs 20] [--jobs 3] [--sizes 8 64 512 4096]
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
from megatron_dcp.runtime.routing_volume import all_to_all_volume, lane_all_gather_volume
from megatron_dcp.scheduling import Plan, build_scheduler
from megatron_dcp.testing import run_distributed
from megatron_dcp.tools.bench_train.stats import Interval, median_interval, speedup_interval

MIB = 1024 * 1024
MEASURED_N = 8


@dataclass(frozen=True)
class Workload:
    """One global batch: lognormal lengths, the same number of samples on every DP rank."""

    size: int
    cp_size: int
    samples_per_dp_rank: int
    median: float = 1024.0
    sigma: float = 1.0
    budget: int = 4096

    @property
    def dp_size(self) -> int:
        return self.size // self.cp_size

    def lengths(self, seed: int) -> GlobalLengths:
        rng = random.Random(seed)
        longest = self.size * self.budget
        count = self.dp_size * self.samples_per_dp_rank
        seqlens = [
            min(longest, max(1, round(rng.lognormvariate(math.log(self.median), self.sigma))))
            for _ in range(count)
        ]
        return GlobalLengths(tuple(seqlens), (self.samples_per_dp_rank,) * self.dp_size)

    def plan(self, seed: int) -> Plan:
        scheduler = build_scheduler(
            "default_dynamic_cp",
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            max_seqlen_per_dp_cp_rank=self.budget,
        )
        return scheduler.schedule(self.lengths(seed).seqlens)


def _sample(sample_id: int, length: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 32000, (length,), generator=torch.Generator().manual_seed(sample_id))
    return {
        "tokens": tokens,
        "labels": tokens.roll(-1),
        "loss_mask": torch.ones(length, dtype=torch.float32),
    }


def _slowest(call: Callable[[], RoutedSamples]) -> float:
    """Seconds of ``call`` on the slowest rank (started together after a barrier)."""
    dist.barrier()
    start = time.perf_counter()
    call()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _worker(rank: int, world_size: int, workload: Workload, pairs: int, seed: int) -> dict:
    """Both routings of one global batch on this rank: bytes, kept samples and paired times."""
    plan, lengths = workload.plan(seed), workload.lengths(seed)
    cp = workload.cp_size
    local = {i: _sample(i, plan.seqlens[i]) for i in lengths.ids_of(rank // cp)}
    schema = SampleSchema.of(next(iter(local.values())))
    lanes = [dist.new_group(list(range(c, world_size, cp))) for c in range(cp)]
    routings = {
        "a2a": lambda: route_samples(plan, local, rank, None, lengths.owner_of, schema=schema),
        "lane": lambda: route_by_lane_all_gather(
            plan, local, rank, lanes[rank % cp], lengths.owner_of, schema=schema
        ),
    }
    results = {name: call() for name, call in routings.items()}  # also warms gloo's pairs up
    times: dict[str, list[float]] = {"a2a": [], "lane": []}
    for round_index in range(pairs):
        order = ("a2a", "lane") if round_index % 2 == 0 else ("lane", "a2a")
        for name in order:
            times[name].append(_slowest(routings[name]))
    return {
        "samples": len(results["a2a"].samples),
        "a2a_received": results["a2a"].bytes_received,
        "lane_received": results["lane"].bytes_received,
        "times": times,
    }


def measure(workload: Workload, pairs: int, jobs: int) -> tuple[list[dict], list[dict]]:
    """Per-rank figures of the first job, and rank 0's paired times of every job (one seed
    per job: a different global batch each)."""
    runs = [
        run_distributed(_worker, workload.size, workload, pairs, job, timeout_s=900)
        for job in range(jobs)
    ]
    return runs[0], [run[0]["times"] for run in runs]


def _interval(value: Interval, scale: float = 1.0, digits: int = 1) -> str:
    return (
        f"{value.value * scale:.{digits}f} "
        f"[{value.low * scale:.{digits}f}, {value.high * scale:.{digits}f}]"
    )


def measured_table(workload: Workload, ranks: list[dict], times: list[dict]) -> str:
    """The N = 8 table: bytes per rank (job 0), then the paired times of every job."""
    plan = workload.plan(0)
    owner_of = workload.lengths(0).owner_of
    computed = all_to_all_volume(plan, owner_of, 20), lane_all_gather_volume(plan, owner_of, 20)
    lines = [
        f"measured: N = {workload.size} (dp {workload.dp_size} x cp {workload.cp_size}), "
        f"{len(plan.seqlens)} samples, {sum(plan.seqlens)} tokens, CP sizes "
        f"{plan.cp_size_histogram()}",
        f"{'pos':>3} {'samples':>7} | {'a2a recv MiB':>12} {'peers':>5} | "
        f"{'lane recv MiB':>13} {'peers':>5} {'sources':>7}",
    ]
    for position, rank in enumerate(ranks):
        a2a, lane = computed[0][position], computed[1][position]
        assert (rank["a2a_received"], rank["lane_received"]) == (
            a2a.bytes_received,
            lane.bytes_received,
        ), "measured bytes must equal runtime.routing_volume's"
        lines.append(
            f"{position:>3} {rank['samples']:>7} | {rank['a2a_received'] / MIB:>12.2f} "
            f"{len(a2a.peers):>5} | {rank['lane_received'] / MIB:>13.2f} "
            f"{len(lane.peers):>5} {len(lane.sources):>7}"
        )
    lines.append("time, slowest rank per round (ms, median [95% interval]):")
    for job, job_times in enumerate(times):
        a2a, lane = job_times["a2a"], job_times["lane"]
        lines.append(
            f"  job {job}: all-to-all {_interval(median_interval(a2a), 1e3)}  lane all-gather "
            f"{_interval(median_interval(lane), 1e3)}  Σ lane / Σ all-to-all "
            f"{_interval(speedup_interval(lane, a2a), digits=2)}  ({len(a2a)} pairs)"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ComputedRow:
    """One domain size's figures per rank, both routings (bytes in MiB)."""

    size: int
    a2a_received_mean: float
    a2a_received_max: float
    a2a_peers_max: int
    a2a_peers_union_max: int
    lane_received: float
    lane_peers: int
    lane_sources: int
    lane_buffer: float


def computed_row(workload: Workload, batches: int) -> ComputedRow:
    """The figures of ``batches`` global batches of ``workload`` (peers: one batch, and the
    union over all of them)."""
    union: list[set[int]] = [set() for _ in range(workload.size)]
    received, peers_max, lane_received, buffers = [], 0, [], []
    for seed in range(batches):
        plan, owner_of = workload.plan(seed), workload.lengths(seed).owner_of
        payload = [0] * workload.dp_size  # bytes per DP replica: the gather pads to the largest
        for i, length in enumerate(plan.seqlens):
            payload[owner_of(i)] += 20 * length
        buffers.append(workload.dp_size * max(payload))
        a2a = all_to_all_volume(plan, owner_of, 20)
        received.extend(v.bytes_received for v in a2a)
        peers_max = max(peers_max, max(len(v.peers) for v in a2a))
        for v in a2a:
            union[v.position] |= v.peers
        lane_received.append(lane_all_gather_volume(plan, owner_of, 20)[0].bytes_received)
    lane = lane_all_gather_volume(plan, owner_of, 20)[0]
    return ComputedRow(
        size=workload.size,
        a2a_received_mean=statistics.mean(received) / MIB,
        a2a_received_max=max(received) / MIB,
        a2a_peers_max=peers_max,
        a2a_peers_union_max=max(len(u) for u in union),
        lane_received=statistics.mean(lane_received) / MIB,
        lane_peers=len(lane.peers),
        lane_sources=len(lane.sources),
        lane_buffer=statistics.mean(buffers) / MIB,
    )


def computed_table(rows: list[ComputedRow], cp: int, batches: int) -> str:
    lines = [
        f"computed (runtime.routing_volume), cp {cp}, per rank; peers over {batches} batches:",
        "| N | all-to-all: MiB received (mean / max) | peers, one batch (max) | "
        f"peers over {batches} batches (max) | lane all-gather: MiB received | direct peers | "
        "sources | gather buffer MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.size:,} | {r.a2a_received_mean:.2f} / {r.a2a_received_max:.2f} | "
            f"{r.a2a_peers_max} | {r.a2a_peers_union_max} | {r.lane_received:,.1f} | "
            f"{r.lane_peers} | {r.lane_sources:,} | {r.lane_buffer:,.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="static CP size (lane = N / cp ranks)")
    parser.add_argument("--samples-per-dp-rank", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=20, help="timed rounds per job (0: none)")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--batches", type=int, default=8, help="global batches per size")
    args = parser.parse_args()
    if args.pairs and args.jobs:
        workload = Workload(MEASURED_N, args.cp, args.samples_per_dp_rank)
        ranks, times = measure(workload, args.pairs, args.jobs)
        print(measured_table(workload, ranks, times), end="\n\n")
    rows = [
        computed_row(Workload(size, args.cp, args.samples_per_dp_rank), args.batches)
        for size in args.sizes
    ]
    print(computed_table(rows, args.cp, args.batches))


if __name__ == "__main__":
    main()
