#!/usr/bin/env python
"""The cost of one packed sequence, measured by a controlled sweep (docs/performance.md, "The
missing term: a cost per sequence").

Every run trains the same GPT on sequences of one length L, with the tokens per rank held
fixed (global batch = TOKENS / L sequences), so that only the number of sequences a rank packs
changes, and with it the quadratic attention work (Σ L² = tokens × L). Each run is a
``megatron-dcp bench-train`` of the arms static and dcp with ``--dcp-prefetch off`` (the batch's
preparation between steps, outside the timed steps; bench-train's default on CPU, given here for
any machine); the dcp arm puts every sequence on one rank (L ≤ the budget). For each L the
script reads:

- the dcp arm's busy forward-backward seconds per rank and step (``times.jsonl``) of the
  batches that were not profiled, with the plan's features (``plans.jsonl``);
- the busiest rank's seconds per region (``bench-train --profile``) of the profiled batches.

Then it fits ``busy = c + b·Σ L² + s·n`` over the runs by least squares (``n`` sequences per
rank-step; the tokens are the same in every run, so their cost is in ``c``), and the same form
for each region: ``s`` is the cost of one more sequence at equal tokens.

    python scripts/bench_sequence_cost.py [--lengths 32,64,128,256,512] [--out DIR]

About 3 minutes on a 2-core machine (5 runs); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "512",
         "--num-attention-heads", "4", "--seq-length", "1024",
         "--max-position-embeddings", "1024", "--max-seqlen-per-dp-cp-rank", "512"]  # fmt: skip
ARMS = ("static", "dcp")


def run(length: int, tokens: int, out: Path, python: str) -> Path:
    """One bench-train run at sequence length ``length``; its output folder."""
    folder = out / f"L{length}"
    command = [
        python, "-m", "megatron_dcp.tools", "bench-train", "--nproc", "2", "--out", str(folder),
        "--arms", ",".join(ARMS), "--batches", "6", "--warmup", "1", "--profile", "2", *MODEL,
        "--global-batch-size", str(tokens // length), "--dcp-prefetch", "off",
        "--varlen-distribution", f"constant:value={length}",
    ]  # fmt: skip
    print(f"L={length}: {tokens // length} sequences per global batch ...", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return folder


def busy_points(folder: Path, profiled: Sequence[int]) -> List[Tuple[float, float, float]]:
    """(Σ L², sequences, busy seconds) per rank-step of the dcp arm's unprofiled batches."""
    from megatron_dcp.tools.bench_train.arms import arm_at

    plans = {}
    for line in (folder / "plans.jsonl").read_text().splitlines():
        record = json.loads(line)
        plans[record["batch"]] = record["arms"]["dcp"]
    points = []
    for line in (folder / "times.jsonl").read_text().splitlines():
        record = json.loads(line)
        batch, arm = arm_at(record["call"], ARMS)
        if arm != "dcp" or batch in profiled or batch == 0:
            continue
        for position, seconds in zip(plans[batch]["sequences"], record["times"]):
            points.append((float(sum(length * length for length, _ in position)),
                           float(len(position)), seconds))  # fmt: skip
    return points


def region_points(folder: Path, length: int) -> Dict[str, Tuple[float, float, float]]:
    """region → (Σ L², sequences, seconds) of the dcp arm's busiest rank, per profiled batch on
    average (every sequence of the run has length ``length``)."""
    from megatron_dcp.tools.bench_train.profile_report import busiest

    rank = busiest(folder)["dcp"]
    square, sequences = rank.per_batch("tokens") * length, rank.per_batch("sequences")
    return {region: (square, sequences, rank.ms(region) / 1e3) for region in rank.regions}


def fit(points: List[Tuple[float, float, float]]) -> Tuple[float, float, float]:
    """Least squares of ``y = c + b·x2 + s·n`` over (x2, n, y) points: (c, b, s)."""
    design = np.array([[1.0, x2, n] for x2, n, _ in points])
    target = np.array([y for _, _, y in points])
    solution, *_ = np.linalg.lstsq(design, target, rcond=None)
    return tuple(float(v) for v in solution)  # type: ignore[return-value]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="32,64,128,256,512")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per global batch")
    parser.add_argument("--out", type=Path, default=Path("bench_out/sequence_cost"))
    parser.add_argument("--python", default=sys.executable)
    options = parser.parse_args(argv)
    lengths = [int(v) for v in options.lengths.split(",")]
    busy: List[Tuple[float, float, float]] = []
    regions: Dict[str, List[Tuple[float, float, float]]] = {}
    rows = []
    for length in lengths:
        folder = run(length, options.tokens, options.out, options.python)
        points = busy_points(folder, profiled=(1, 2))
        busy += points
        per_region = region_points(folder, length)
        for region, point in per_region.items():
            regions.setdefault(region, []).append(point)
        rows.append((length, statistics.median(n for _, n, _ in points),
                     1e3 * statistics.median(s for _, _, s in points),
                     1e3 * per_region.get("RoPE", (0, 0, 0))[2],
                     1e3 * per_region.get("core attention", (0, 0, 0))[2]))  # fmt: skip
    print("\n| L | sequences per rank-step | busy ms (median) | RoPE ms | core attention ms |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| {} | {:.0f} | {:.1f} | {:.1f} | {:.1f} |".format(*row))
    c, b, s = fit(busy)
    print(f"\nbusy = {1e3 * c:.1f} ms + {1e9 * b:.2f} ns · Σ L² + {1e3 * s:.3f} ms · sequences")
    print("\nper region (the busiest rank of the profiled batches, profiler on): ms per sequence")
    for region, points in sorted(regions.items(), key=lambda kv: -fit(kv[1])[2]):
        print(f"  {region:32s} {1e3 * fit(points)[2]:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
