"""The communication targets ("where communication costs"), each checked over every run of a
link-rate sweep: met or not, with the runs that decide it.

- never slower: in every run, DCP's 95 % interval over static and over Megatron dev reaches 1
  (upper end ≥ 1);
- within 15 % of prediction: in every run whose predicted DCP speedup over static is ≥ 1.10,
  the measured speedup is within 15 % of the predicted one;
- DCP beats dev where communication costs: in at least one run at a communication-bound rate
  (FLOPs per byte of link at least an H100's over NVLink), DCP's whole interval over dev is > 1;
- model error ≤ 15 % in every run (median over iterations 5–30);
- order agreement ≥ 90 % where the predicted gap is ≥ 10 % (pairs pooled over every run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from megatron_dcp.tools.link_sweep.runs import SweepRun, flops_per_byte

# FLOPs per byte of link of one GPU: dense bf16 peak (× the 50 % a GEMM achieves) over what one
# GPU sends. H100 SXM over NVLink: 989e12 × 0.5 / 450e9 B/s; over 400 Gb/s InfiniBand (one NIC
# per GPU): 494.5e12 / 50e9 B/s.
H100_NVLINK = 989e12 * 0.5 / 450e9
H100_INFINIBAND = 989e12 * 0.5 / 50e9
PREDICTION_TOLERANCE = 0.15
PREDICTED_GAIN = 1.10
MODEL_ERROR = 0.15
ORDER_AGREEMENT = 0.90


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    detail: str

    def line(self) -> str:
        return f"{'MET' if self.met else 'NOT MET'}: {self.name} ({self.detail})"


def names(runs: Sequence[SweepRun]) -> str:
    return ", ".join(r.name for r in runs) or "none"


def never_slower(runs: Sequence[SweepRun]) -> Target:
    slower = [
        r for r in runs
        if ("dcp" in r.speedup and r.speedup["dcp"].high < 1)
        or (r.dcp_over_dev is not None and r.dcp_over_dev.high < 1)
    ]
    return Target("never slower: DCP's interval over static and over dev reaches 1 in every run",
                  not slower, f"slower in: {names(slower)}")


def within_prediction(runs: Sequence[SweepRun]) -> Target:
    gains = [r for r in runs if r.predicted.get("dcp", 0) >= PREDICTED_GAIN and "dcp" in r.speedup]
    off = [
        r for r in gains
        if abs(r.speedup["dcp"].value / r.predicted["dcp"] - 1) > PREDICTION_TOLERANCE
    ]
    detail = (f"{len(gains) - len(off)} of the {len(gains)} runs predicted ≥ {PREDICTED_GAIN:.2f} "
              "within it")
    detail += f"; off: {names(off)}" if off else ""
    return Target(
        f"within {PREDICTION_TOLERANCE:.0%} of prediction where predicted ≥ {PREDICTED_GAIN:.2f}",
        bool(gains) and not off,
        detail if gains else f"no run predicted a DCP speedup ≥ {PREDICTED_GAIN:.2f}",
    )


def beats_dev(runs: Sequence[SweepRun], flops_per_s: Optional[float]) -> Target:
    bound = [r for r in runs if (flops_per_byte(r, flops_per_s) or 0) >= H100_NVLINK]
    wins = [r for r in bound if r.dcp_over_dev is not None and r.dcp_over_dev.low > 1]
    return Target(
        "DCP over dev, whole interval > 1, at some communication-bound rate "
        f"(≥ {H100_NVLINK:.3g} FLOPs/byte)",
        bool(wins),
        f"{len(wins)}/{len(bound)} communication-bound runs: {names(wins)}",
    )


def model_error(runs: Sequence[SweepRun]) -> Target:
    known = [r for r in runs if r.model_error is not None]
    over = [r for r in known if r.model_error > MODEL_ERROR]
    return Target(
        f"model error ≤ {MODEL_ERROR:.0%} in every run (iterations 5–30)",
        bool(known) and not over and len(known) == len(runs),
        f"{len(known) - len(over)}/{len(runs)} runs; over: {names(over)}",
    )


def order_agreement(runs: Sequence[SweepRun]) -> Target:
    agree, total = sum(r.clear_agree for r in runs), sum(r.clear_total for r in runs)
    share = agree / total if total else 0.0
    return Target(
        f"order agreement ≥ {ORDER_AGREEMENT:.0%} where the predicted gap is ≥ 10 %",
        total > 0 and share >= ORDER_AGREEMENT,
        f"{agree}/{total} pairs = {share:.0%}" if total else "no pair with a gap ≥ 10 %",
    )


def check_targets(runs: Sequence[SweepRun], flops_per_s: Optional[float]) -> List[Target]:
    return [
        never_slower(runs),
        within_prediction(runs),
        beats_dev(runs, flops_per_s),
        model_error(runs),
        order_agreement(runs),
    ]
