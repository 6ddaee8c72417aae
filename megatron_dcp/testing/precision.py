"""The float32 rounding error of an oracle run, measured: the same single-process run in float64
(exact, to float32's eyes) and in float32 in two sample orders (``ExactRun``, shared with
``megatron-dcp check``'s reference arm: ``tools.check.rounding``). How far a correct distributed
float32 run may stray from the exact values is then a multiple of what float32 rounding did to
the oracle itself (``testing.oracle``), on whatever CPU runs the test."""

from __future__ import annotations

import torch

from megatron_dcp.tools.check.rounding import (
    ExactRun,
    exact_run,
    largest_difference,
    largest_magnitude,
    to_dtype,
)

__all__ = ["ExactRun", "exact_run", "largest_difference", "largest_magnitude", "to_float64"]


def to_float64(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with float64 parameters, computing in float64."""
    return to_dtype(model, torch.float64)
