"""``megatron-dcp calibrate``: measure the real model on this machine and fit the cost model the
scheduler plans with.

    megatron-dcp calibrate --output profile.json [--nproc 2] [--lengths 128,256,...] \\
        [--pack-sizes 1,2,4] [--max-tokens N] [--repeats 3] [--hold-out 0.25] \\
        --num-layers 2 --hidden-size 128 ... (megatron's model flags, as for pretrain_gpt)

The grid: every CP size (powers of two up to ``--nproc``) × every length × every pack size (that
many sequences of that length in one micro-batch, at most ``--max-tokens`` tokens, default
``--seq-length``). :mod:`~megatron_dcp.tools.calibration.rank_timing` launches the ranks, builds the
GPT model from the megatron flags and times forward + backward of each point's micro-batch on its
DCP group (one warm-up, then the min over ``--repeats`` passes, short points timed several times
per pass). A seeded share ``--hold-out`` of
the points (per CP size, ``--seed``) stays out of the fit; the nine coefficients of
:mod:`~megatron_dcp.scheduling.cost_fit` are fitted on the rest (non-negative, relative errors):
every point is one micro-batch's time, so the micro-batch cost is the fit's fixed cost per
point, and the points carry the score cache size of the hardware profile
(``--dcp-hardware-profile``, default ``cpu-gloo``: :func:`cache_size`), so that the spill term
is fitted where a point's score block outgrows it;
the held-out points are predicted by the stored cost model, and the profile (coefficients plus
how they were measured: backend, ranks, threads, model flags, grid, errors, every point) is
written with ``save_profile``; training reads it with ``--dcp-cost-profile``.

On CPU every rank is one process with one torch thread; ranks that share a core time each other,
so ``--nproc`` may not exceed the cores. The CP sizes measured are therefore 1 .. nproc: the ring
terms (``comm``, ``ring_step``) and the CP attention rate (``cp_efficiency``) are fitted from
CP ≤ nproc and extrapolated to larger groups by the model's ``(c−1)`` form. Times cover one
micro-batch's forward and backward only (no planning, gradient reduction or optimizer step).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.hardware import DEFAULT_CPU_PROFILE
from megatron_dcp.scheduling.cost_fit import (
    FEATURES,
    coefficients,
    fit,
    from_coefficients,
    predict,
    relative_errors,
)
from megatron_dcp.tools.calibration.rank_timing import Point, TimingJob, measure
from megatron_dcp.tools.launching.training_runs import available_cores

SPILL = FEATURES.index("spill")
# The coefficients a calibration fits: every feature but the vision encoder's (its ranks run a
# GPT, so that column is 0 and its coefficient stays 0).
FITTED = len(FEATURES) - 1
DEFAULT_LENGTHS = (128, 256, 512, 1024, 2048, 4096)
DEFAULT_PACK_SIZES = (1, 2, 4)
DEFAULT_REPEATS = 3
DEFAULT_HOLD_OUT = 0.25
PROG = "megatron-dcp calibrate"


def cache_size(args: argparse.Namespace) -> Tuple[float, str]:
    """The spill term's threshold for megatron's model ``args``: the score elements of one
    sequence's block that stay in cache (``CostModel.spill_elements``: the profile's cache bytes
    over 4 bytes × heads per rank; inf where the profile has none), and the hardware profile it
    comes from (``--dcp-hardware-profile``, default ``cpu-gloo``: calibrate runs on CPU)."""
    from megatron_dcp.integration.model_cost import cost_model_of, model_shape_from_args

    name = getattr(args, "dcp_hardware_profile", None) or DEFAULT_CPU_PROFILE
    return cost_model_of(model_shape_from_args(args), name).spill_elements, name


def grid(
    options: argparse.Namespace, seq_length: int, spill_elements: float = math.inf
) -> List[Point]:
    """Every CP size × length × pack size with at most ``--max-tokens`` tokens, the points
    carrying the cache size ``spill_elements`` (:func:`cache_size`)."""
    lengths = options.lengths
    if lengths is None:
        lengths = tuple(n for n in DEFAULT_LENGTHS if n <= seq_length) or (seq_length,)
    elif max(lengths) > seq_length:
        raise ValueError(
            f"--lengths={','.join(map(str, lengths))}: longer than --seq-length={seq_length}; "
            "drop those lengths or raise --seq-length (and --max-position-embeddings)."
        )
    cap = options.max_tokens or seq_length
    return [
        Point((length,) * count, cp, spill_elements)
        for cp in cp_sizes(options.nproc)
        for length in sorted(lengths)
        for count in sorted(options.pack_sizes)
        if count * length <= cap
    ]


def cp_sizes(nproc: int) -> Tuple[int, ...]:
    """The CP sizes measured: powers of two up to ``nproc``."""
    return tuple(1 << k for k in range(nproc.bit_length()) if 1 << k <= nproc)


def split_hold_out(points: Sequence[Point], share: float, seed: int) -> List[bool]:
    """Per point, whether it is held out: ``round(share·n)`` (at least 1 when ``n > 1``) of the
    ``n`` points of each CP size, drawn with ``random.Random(seed)`` (the same split for the
    same grid and seed)."""
    rng = random.Random(seed)
    held = [False] * len(points)
    for cp in sorted({p.cp_size for p in points}):
        members = [i for i, p in enumerate(points) if p.cp_size == cp]
        count = max(1, round(share * len(members))) if len(members) > 1 else 0
        for i in rng.sample(members, count):
            held[i] = True
    return held


def check_split(held: Sequence[bool], share: float) -> None:
    """Enough points on both sides: one per coefficient in the fit, one held out."""
    n_held, n_fit = sum(held), len(held) - sum(held)
    if n_fit < FITTED or n_held < 1:
        raise ValueError(
            f"--hold-out={share} leaves {n_fit} fit and {n_held} held-out points of {len(held)}: "
            f"the fit needs at least {FITTED} and the check 1. Add --lengths or "
            "--pack-sizes (or raise --max-tokens), or change --hold-out."
        )


@dataclass(frozen=True)
class Calibration:
    """The fitted cost model and every point: measured and predicted seconds, held out or not."""

    cost: CostModel
    points: Tuple[Point, ...]
    measured: Tuple[float, ...]
    predicted: Tuple[float, ...]
    held: Tuple[bool, ...]

    def errors(self, held: bool) -> List[float]:
        """Relative errors of the stored cost model on the held-out (or fit) points."""
        theta = coefficients(self.cost)
        chosen = [i for i, h in enumerate(self.held) if h == held]
        rows = [self.points[i].features() for i in chosen]
        return relative_errors(theta, rows, [self.measured[i] for i in chosen])


def fit_points(
    points: Sequence[Point], measured: Sequence[float], held: Sequence[bool]
) -> Calibration:
    """Fit on the points not held out; predictions are the stored model's (η clamped to 1, its
    cache size the points')."""
    train = [i for i, h in enumerate(held) if not h]
    theta = fit([points[i].features() for i in train], [measured[i] for i in train])
    spill_elements = points[0].spill_elements if points else math.inf
    cost = from_coefficients(theta, name="calibrated", spill_elements=spill_elements)
    stored = coefficients(cost)
    predicted = tuple(predict(stored, p.features()) for p in points)
    return Calibration(cost, tuple(points), tuple(measured), predicted, tuple(held))


def source(
    result: Calibration,
    options: argparse.Namespace,
    args: argparse.Namespace,
    model_flags: Sequence[str],
) -> Dict[str, Any]:
    """How the profile was measured (the profile's ``source``)."""
    held, train = result.errors(True), result.errors(False)
    threshold = result.cost.spill_elements
    return {
        "tool": PROG,
        "backend": "gloo",
        "device": "cpu",
        "ranks": options.nproc,
        "threads_per_rank": 1,
        "cores": available_cores(),
        "model_flags": list(model_flags),
        "grid": {
            "lengths": sorted({p.lengths[0] for p in result.points}),
            "pack_sizes": sorted({len(p.lengths) for p in result.points}),
            "cp_sizes": sorted({p.cp_size for p in result.points}),
            "max_tokens": options.max_tokens or args.seq_length,
            "repeats": options.repeats,
            "hold_out": options.hold_out,
            "seed": args.seed,
        },
        "spill_elements": None if math.isinf(threshold) else threshold,
        "spilled_points": sum(1 for p in result.points if p.features()[SPILL] > 0),
        "fit_points": len(train),
        "held_out_points": len(held),
        "held_out_median_error": statistics.median(held),
        "held_out_max_error": max(held),
        "train_median_error": statistics.median(train),
        "points": [
            {
                "lengths": list(p.lengths),
                "cp_size": p.cp_size,
                "measured_s": t,
                "predicted_s": q,
                "held_out": h,
            }
            for p, t, q, h in zip(result.points, result.measured, result.predicted, result.held)
        ],
    }


def report(result: Calibration) -> List[str]:
    """The held-out table, the coefficients and the errors, as printed lines."""
    lines = [
        f"{'lengths':>10}  {'CP':>3}  {'measured ms':>11}  {'predicted ms':>12}  {'rel err':>7}"
    ]
    for p, t, q, h in zip(result.points, result.measured, result.predicted, result.held):
        if h:
            lines.append(
                f"{p.label():>10}  {p.cp_size:>3}  {t * 1e3:>11.2f}  {q * 1e3:>12.2f}  "
                f"{abs(q - t) / t:>7.1%}"
            )
    c = result.cost
    lines += [
        "",
        f"coefficients (seconds): linear {c.linear:.4g}/token, quadratic {c.quadratic:.4g}/token², "
        f"comm {c.comm:.4g}/token, ring_step {c.ring_step:.4g}, cp_efficiency "
        f"{c.cp_efficiency:.4g}, microbatch {c.microbatch:.4g}, spill {c.spill:.4g}/element "
        f"beyond {c.spill_elements:.4g} per sequence",
    ]
    held, train = result.errors(True), result.errors(False)
    lines.append(
        f"held-out relative error: median {statistics.median(held):.1%}, max {max(held):.1%} "
        f"({len(held)} points; fit median {statistics.median(train):.1%} on {len(train)} points)"
    )
    return lines


def run_measurement(
    points: Sequence[Point], options: argparse.Namespace, args: argparse.Namespace
) -> Optional[List[float]]:
    """Seconds per point, or None (and the reason on stderr) when the ranks failed."""
    from megatron_dcp.tools.launching.local_ranks import DistributedTestError

    print(
        f"calibrate: {len(points)} points on CP sizes {'/'.join(map(str, cp_sizes(options.nproc)))}"
        f", {options.nproc} ranks × 1 thread, 1 warm-up + {options.repeats} timed passes ..."
    )
    sys.stdout.flush()
    job = TimingJob(tuple(points), options.repeats, args.seed)
    try:
        return measure(args, job, options.nproc, options.timeout)
    except DistributedTestError as error:
        print(f"{PROG}: error: the measurement failed: {error}", file=sys.stderr)
        return None
