"""Per-element cost of the CPU backend's reference attention against the size of its score block:
the measurement behind the ``cpu-gloo`` profile's score-spill term (docs/performance.md).

    .venv/bin/python scripts/bench_attention_spill.py [--heads 4] [--head-dim 32]

For each length L it times forward + backward of ``runtime.attention._attend`` (one thread, best of
5) on a whole sequence (an L × L score block, CP size 1) and on one rank's zigzag share at CP 2
(L/2 × L), and prints nanoseconds per score element (all heads together).
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_dcp.runtime.attention import _attend

LENGTHS = (256, 512, 1024, 1536, 2048, 3072, 4096)


def seconds(queries: int, keys: int, heads: int, dim: int, repeats: int = 5) -> float:
    q, k, v = (torch.randn(n, heads, dim, requires_grad=True) for n in (queries, keys, keys))
    mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _attend(q, k, v, mask, dim**-0.5).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--head-dim", type=int, default=32, help="head dimension (default 32)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'L':>5} {'CP 1 ms':>9} {'ns/el':>7} {'CP 2 share ms':>14} {'ns/el':>7} {'MiB scores CP1':>15}")
    for length in LENGTHS:
        whole = seconds(length, length, args.heads, args.head_dim)
        share = seconds(length // 2, length, args.heads, args.head_dim)
        mib = args.heads * length * length * 4 / 2**20
        print(
            f"{length:>5} {whole * 1e3:>9.1f} {whole / length**2 * 1e9:>7.1f} "
            f"{share * 1e3:>14.1f} {share / (length * length / 2) * 1e9:>7.1f} {mib:>15.0f}"
        )


if __name__ == "__main__":
    main()
