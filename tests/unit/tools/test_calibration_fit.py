"""``megatron-dcp calibrate``'s fit (``tools/calibration/fit.py``) on synthetic timings from a known
cost model, spill included: every point is one micro-batch timed alone and carries the score
cache size of the hardware profile, so the fit recovers all seven coefficients (the micro-batch
cost and the spill term among them) and predicts the held-out points exactly; points without the
cache size cannot express the spill and miss. Pure Python, no ranks."""

import argparse
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.cost_fit import FEATURES, coefficients, predict
from megatron_dcp.scheduling.hardware import hardware_profile
from megatron_dcp.scheduling.model_shape import ModelShape
from megatron_dcp.tools.calibration.fit import cache_size, fit_points, grid, split_hold_out
from megatron_dcp.tools.calibration.rank_timing import Point

# docs/cost_model.md's calibration command: 2 layers, hidden 128, 4 heads, FFN 512, vocabulary
# 1024, sequences up to 4096 tokens, 2 ranks.
SHAPE = dict(hidden_size=128, ffn_hidden_size=512, num_layers=2, num_attention_heads=4)
PRIOR = CostModel.from_model_shape(
    ModelShape(**SHAPE, num_query_groups=4, vocab_size=1024), hardware_profile("cpu-gloo")
)
# The "machine": every coefficient off the prior, η < 1, a spill and a micro-batch cost the
# prior does not know.
TRUTH = replace(
    PRIOR,
    linear=0.8 * PRIOR.linear,
    quadratic=1.3 * PRIOR.quadratic,
    comm=2.0 * PRIOR.comm,
    ring_step=0.5 * PRIOR.ring_step,
    cp_efficiency=0.9,
    microbatch=3.0 * PRIOR.microbatch,
    spill=2.0 * PRIOR.spill,
)


def calibration_grid(spill_elements: float):
    options = argparse.Namespace(nproc=2, lengths=None, pack_sizes=(1, 2, 4), max_tokens=None)
    return grid(options, seq_length=4096, spill_elements=spill_elements)


def synthetic(points):
    """Every point's time under ``TRUTH`` (its features with the truth's cache size)."""
    theta, cache = coefficients(TRUTH), TRUTH.spill_elements
    return [predict(theta, Point(p.lengths, p.cp_size, cache).features()) for p in points]


def test_the_cache_size_comes_from_the_hardware_profile():
    args = SimpleNamespace(**SHAPE, vocab_size=1024, dcp_hardware_profile=None)
    assert cache_size(args) == (PRIOR.spill_elements, "cpu-gloo")
    assert PRIOR.spill_elements == 16 * 2**20 / (4 * 4)  # 16 MiB of fp32 scores, 4 heads
    args.dcp_hardware_profile = "h100-nvlink"  # flash attention: no score block, no spill
    assert cache_size(args) == (math.inf, "h100-nvlink")


def test_the_fit_recovers_every_coefficient_spill_and_micro_batch_included():
    points = calibration_grid(PRIOR.spill_elements)
    spill = FEATURES.index("spill")
    assert sum(1 for p in points if p.features()[spill] > 0) >= 4  # 2048 and 4096 tokens
    held = split_hold_out(points, 0.25, seed=1234)
    result = fit_points(points, synthetic(points), held)
    assert result.cost.spill_elements == PRIOR.spill_elements
    assert coefficients(result.cost) == pytest.approx(coefficients(TRUTH), rel=1e-6)
    assert result.cost.microbatch == pytest.approx(TRUTH.microbatch, rel=1e-6)
    assert result.cost.spill == pytest.approx(TRUTH.spill, rel=1e-6)
    assert max(result.errors(held=True)) < 1e-6


def test_points_without_the_cache_size_cannot_fit_the_spill():
    """What calibrate did before: the same times, points without a cache size (no spill
    feature); the long points' spill is charged to the other coefficients and the fit misses."""
    points = calibration_grid(math.inf)
    held = split_hold_out(points, 0.25, seed=1234)
    result = fit_points(points, synthetic(points), held)
    assert result.cost.spill == 0.0
    worst = max(result.errors(held=False) + result.errors(held=True))
    assert worst > 0.2, worst  # 50 %: linear and comm at 0, microbatch +31 %
