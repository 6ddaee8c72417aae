#!/usr/bin/env python
"""Benchmark planning off the critical path (``--dcp-prefetch``) with a synthetic slow step.

4 gloo ranks (dp 2 × cp 2), the real DCP wrapper (``build_forward_backward``): each global batch
is read from a data iterator that sleeps ``--fetch-ms`` per global batch (a slow loader), its
lengths exchanged, planned by ``default_dynamic_cp`` and routed for real; megatron's
forward-backward is replaced by a sleep of ``--step-ms`` (the model's step, which releases the
GIL like GPU kernels do). Per setting, the median time per training call over ``--steps`` calls
(the first excluded), without and with prefetch, beside the time of one preparation (fetch +
exchange + plan + route + pack, measured without prefetch) and the two predictions:
sum = step + preparation (without), max = max(step, preparation) (with).

    python scripts/bench_prefetch.py [--steps 8] [--sequences 256]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from typing import Iterator

from megatron_dcp.integration.config import DCPConfig
from megatron_dcp.integration.forward_backward import build_forward_backward
from megatron_dcp.integration.patches import apply_patches
from megatron_dcp.testing import run_distributed
from megatron_dcp.testing.gpt import build_tiny_gpt, init_megatron, make_samples

SETTINGS = ((200, 50), (200, 150), (100, 250))  # (step ms, fetch ms per global batch)


def slow_stream(samples: list, per_batch: int, fetch_s: float) -> Iterator[dict]:
    """The samples, one global-batch share at a time, each share ``fetch_s`` late."""
    for index, sample in enumerate(samples):
        if index % per_batch == 0:
            time.sleep(fetch_s)
        yield sample


def bench(rank: int, world: int, prefetch: bool, step_ms: int, fetch_ms: int, args) -> dict:
    from megatron.core import parallel_state

    logging.disable(logging.WARNING)  # megatron's deprecation notice for GPTModel, per worker
    init_megatron(cp=2)
    apply_patches()
    (model,) = build_tiny_gpt(cp=2)
    config = DCPConfig.for_model(model.config, 512, prefetch=prefetch)

    def sleeping_step(**kwargs):
        time.sleep(step_ms / 1e3)
        return []

    wrapper = build_forward_backward(model.config, config, forward_backward_func=sleeping_step)
    share = args.sequences // parallel_state.get_data_parallel_world_size()
    rng = random.Random(parallel_state.get_data_parallel_rank())
    lengths = [min(1000, int(rng.lognormvariate(5, 1)) + 1) for _ in range(share * args.steps)]
    stream = slow_stream(make_samples(lengths), share, fetch_ms / 1e3)
    calls, prepare = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        wrapper(forward_step_func=None, data_iterator=stream, model=model, num_microbatches=share)
        calls.append(time.perf_counter() - start)
        prepare.append(calls[-1] - step_ms / 1e3)
    wrapper.close()
    wrapper.groups.destroy()
    return dict(call=statistics.median(calls[1:]), prepare=statistics.median(prepare[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=256, help="per global batch")
    args = parser.parse_args()
    print("step ms  fetch ms  preparation ms  sum ms  max ms  no prefetch ms  prefetch ms")
    for step_ms, fetch_ms in SETTINGS:
        off = run_distributed(bench, 4, False, step_ms, fetch_ms, args, timeout_s=600)
        on = run_distributed(bench, 4, True, step_ms, fetch_ms, args, timeout_s=600)
        prep = max(r["prepare"] for r in off) * 1e3
        print(
            f"{step_ms:7d}  {fetch_ms:8d}  {prep:14.0f}  {step_ms + prep:6.0f}  "
            f"{max(step_ms, prep):6.0f}  {max(r['call'] for r in off) * 1e3:14.0f}  "
            f"{max(r['call'] for r in on) * 1e3:11.0f}"
        )


if __name__ == "__main__":
    main()
