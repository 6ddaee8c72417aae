"""The FLOP rate one rank achieves on this machine, with the training run's own GEMM shapes.

A GPT layer's weight GEMMs are ``tokens × hidden`` against ``hidden × 3·hidden`` (QKV),
``hidden × hidden`` (attention output), ``hidden × ffn`` and ``ffn × hidden`` (the MLP), and in
the backward pass each one's input gradient (``tokens × n @ n × k``) and weight gradient
(``k × tokens @ tokens × n``). Each is timed in float32 on one thread (``torch.set_num_threads(1)``: a rank has one core here), best
of a few repeats after a warm-up, and the rate is Σ FLOPs / Σ seconds over the twelve: what one rank
computes per second, the numerator of the *FLOPs per byte of link* of the link-rate sweep
(``scripts/bench_links.sh``, ``megatron-dcp link-sweep``).

    python -m megatron_dcp.tools.gemm_rate --tokens 1024 --hidden 128 --ffn 512 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPEATS = 5
MIN_SECONDS = 0.05  # each timing repeats its GEMM until it has run at least this long


def layer_shapes(tokens: int, hidden: int, ffn: int) -> List[Tuple[str, int, int, int]]:
    """(name, m, k, n) of each weight GEMM of one layer: forward, input and weight gradient."""
    forward = [
        ("qkv", tokens, hidden, 3 * hidden),
        ("proj", tokens, hidden, hidden),
        ("fc1", tokens, hidden, ffn),
        ("fc2", tokens, ffn, hidden),
    ]
    shapes = []
    for name, m, k, n in forward:
        shapes += [(name, m, k, n), (f"{name}.dx", m, n, k), (f"{name}.dw", k, m, n)]
    return shapes


def time_gemm(m: int, k: int, n: int, repeats: int = REPEATS) -> float:
    """Seconds of one fp32 ``m × k @ k × n``, best of ``repeats`` timings."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)  # warm-up
    calls = 1
    while True:  # enough calls per timing that the clock's resolution does not matter
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        elapsed = time.perf_counter() - start
        if elapsed >= MIN_SECONDS:
            break
        calls *= 2
    best = elapsed / calls
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure(tokens: int, hidden: int, ffn: int) -> Dict[str, object]:
    """Every GEMM's GFLOP/s and the overall rate (Σ FLOPs / Σ seconds), on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gemms, flops, seconds = {}, 0.0, 0.0
        for name, m, k, n in layer_shapes(tokens, hidden, ffn):
            t = time_gemm(m, k, n)
            gemms[name] = {"shape": [m, k, n], "gflops_per_s": 2.0 * m * k * n / t / 1e9}
            flops, seconds = flops + 2.0 * m * k * n, seconds + t
    finally:
        torch.set_num_threads(threads)
    return {
        "flops_per_s": flops / seconds,
        "threads": 1,
        "dtype": "float32",
        "tokens": tokens,
        "hidden": hidden,
        "ffn": ffn,
        "gemms": gemms,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_dcp.tools.gemm_rate", description=__doc__)
    p.add_argument("--tokens", type=int, default=1024, help="rows of each GEMM (default 1024)")
    p.add_argument("--hidden", type=int, default=128, help="--hidden-size of the run")
    p.add_argument("--ffn", type=int, default=512, help="--ffn-hidden-size of the run")
    p.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    for flag, value in (("--tokens", args.tokens), ("--hidden", args.hidden), ("--ffn", args.ffn)):
        if value < 1:
            p.error(f"{flag}={value}: must be ≥ 1 (e.g. {flag} 128)")
    result = measure(args.tokens, args.hidden, args.ffn)
    for name, gemm in result["gemms"].items():
        print(f"{name:<8} {'×'.join(map(str, gemm['shape'])):<16} {gemm['gflops_per_s']:8.1f} GFLOP/s")
    print(f"one thread, fp32: {result['flops_per_s'] / 1e9:.1f} GFLOP/s (Σ FLOPs / Σ seconds)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
