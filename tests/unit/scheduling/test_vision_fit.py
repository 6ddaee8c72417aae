"""Where the vision coefficient comes from: a ViT encoder's FLOPs per patch (``ModelShape``),
``CostModel.from_model_shape``, and its fitted feature (``cost_fit``): Σ patches / c per rank."""

import json
from dataclasses import replace

import pytest

from megatron_dcp.scheduling import CostModel, build_scheduler
from megatron_dcp.scheduling.cost_fit import (
    FEATURES,
    CostProfile,
    coefficients,
    fit,
    from_coefficients,
    group_features,
    load_profile,
    microbatch_features,
    predict,
    save_profile,
)
from megatron_dcp.scheduling.hardware import hardware_profile
from megatron_dcp.scheduling.metrics import critical_path
from megatron_dcp.scheduling.model_shape import TRAIN_FACTOR, ModelShape

VISION = FEATURES.index("vision")
VIT = ModelShape(vision_layers=2, vision_hidden=64, vision_ffn_hidden=256,
                 vision_patches_per_tile=10, tp_size=2)  # fmt: skip


def test_vision_flops_per_patch_of_a_vit():
    linear = 2 * (2 * 64 * 4 * 64 + 2 * 2 * 64 * 256) / 2  # 2 layers, TP 2: QKVO and a 2-GEMM MLP
    attention = 2 * 4 * 64 * 10 / 2  # QKᵀ and AV over the tile's 10 patches, no causal mask
    assert VIT.vision_linear_flops() == TRAIN_FACTOR * linear
    assert VIT.vision_attention_flops() == TRAIN_FACTOR * attention
    assert VIT.vision_flops_per_patch() == TRAIN_FACTOR * (linear + attention)
    assert ModelShape().vision_flops_per_patch() == 0.0
    with pytest.raises(ValueError, match="vision"):
        ModelShape(vision_layers=-1)


def test_from_model_shape_prices_the_encoder_on_the_hardware():
    hw = hardware_profile("h100-nvlink")
    cost = CostModel.from_model_shape(VIT, hw)
    expected = VIT.vision_linear_flops() / (hw.peak_flops * hw.gemm_efficiency)
    expected += VIT.vision_attention_flops() / (hw.peak_flops * hw.attention_efficiency)
    assert cost.vision == expected > 0
    assert CostModel.from_model_shape().vision == 0.0  # a text model has no encoder
    assert replace(cost, vision=0.0) == CostModel.from_model_shape(replace(VIT, vision_layers=0), hw)


def test_the_vision_feature_is_patches_over_the_group():
    assert group_features([100, 50], 4, patches=[8, 4])[VISION] == 3.0
    assert group_features([100, 50], 1, patches=[8, 4])[VISION] == 12.0
    assert group_features([100, 50], 4)[VISION] == 0.0
    assert len(group_features([], 2)) == len(FEATURES) == 9


def test_the_fit_recovers_the_vision_coefficient():
    truth = CostModel(2.0, 0.01, comm=0.5, ring_step=20.0, microbatch=40.0, vision=0.3)
    scheduler = build_scheduler("default_dynamic_cp", dp_size=2, cp_size=2,
                                max_seqlen_per_dp_cp_rank=256, cost_model=truth)  # fmt: skip
    rows, times = [], []
    for seed in range(6):
        lengths = [37 * (seed + k) % 400 + 20 for k in range(10)]
        patches = [(seed * 7 + k * 13) % 5 * 100 for k in range(10)]
        plan = scheduler.schedule(lengths, patches)
        for position in microbatch_features(plan):
            rows += position
    theta = coefficients(truth)
    times = [predict(theta, row) for row in rows]
    fitted = from_coefficients(fit(rows, times))
    assert fitted.vision == pytest.approx(0.3, rel=1e-6)
    assert critical_path(plan, fitted) == pytest.approx(critical_path(plan, truth), rel=1e-6)


def test_profiles_keep_vision_and_old_ones_load_without_it(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(str(path), CostProfile(CostModel(1.0, 0.5, vision=0.125), {}))
    assert load_profile(str(path)).cost.vision == 0.125
    data = json.loads(path.read_text())
    del data["coefficients"]["vision"]  # a profile written before the vision term
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).cost.vision == 0.0
    assert from_coefficients([1.0, 0.5, 0.5, 0, 0, 0, 0, 0]).vision == 0.0  # θ of eight
