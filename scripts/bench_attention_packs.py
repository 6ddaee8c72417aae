"""Cost of the CPU backend's reference attention per packed sequence: forward + backward of
``runtime.attention.thd_attention`` on one THD pack of n sequences of L tokens, against one
sequence of the same tokens' score elements, to separate a per-sequence cost from the work.

    .venv/bin/python scripts/bench_attention_packs.py [--heads 4] [--head-dim 32] [--length 64]

For each n it prints the time of the pack (best of 5, one thread), the time the per-element rate
of a single long sequence predicts for its n·L² score elements, and the difference per sequence:
what a planner that prices only tokens and score elements misses per sequence (docs/performance.md,
"Results: the speed-up curve").
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_dcp.runtime.attention import thd_attention

COUNTS = (1, 2, 4, 8, 16, 32)


def seconds(count: int, length: int, heads: int, dim: int, repeats: int = 5) -> float:
    tokens = count * length
    q, k, v = (torch.randn(tokens, heads, dim, requires_grad=True) for _ in range(3))
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        thd_attention(q, k, v, cu, cu).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--head-dim", type=int, default=32, help="head dimension (default 32)")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence (default 64)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    length, heads, dim = args.length, args.heads, args.head_dim
    reference = 1024  # one sequence long enough that its per-sequence cost is negligible
    per_element = seconds(1, reference, heads, dim) / reference**2
    print(f"one {reference}-token sequence: {per_element * 1e9:.1f} ns per score element")
    print(f"{'n':>3} {'tokens':>7} {'pack ms':>8} {'work ms':>8} {'per sequence ms':>16}")
    for count in COUNTS:
        pack = seconds(count, length, heads, dim)
        work = per_element * count * length**2
        print(
            f"{count:>3} {count * length:>7} {pack * 1e3:>8.2f} {work * 1e3:>8.2f} "
            f"{(pack - work) / count * 1e3:>16.3f}"
        )


if __name__ == "__main__":
    main()
