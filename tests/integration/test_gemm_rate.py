"""gemm_rate: the twelve weight GEMMs of one GPT layer (forward, input and weight gradient), their
FLOP count, a measured rate on one thread with the caller's thread count restored, and the JSON the
link-rate sweep records."""

import json

import pytest
import torch

from megatron_dcp.tools import gemm_rate


def test_one_layer_has_every_weight_gemm_forward_and_backward():
    shapes = gemm_rate.layer_shapes(tokens=8, hidden=4, ffn=16)
    assert len(shapes) == 12
    flops = sum(2 * m * k * n for _, m, k, n in shapes)
    # 3 passes × 2 FLOPs × tokens × (h·3h + h·h + h·ffn + ffn·h)
    assert flops == 3 * 2 * 8 * (4 * 12 + 4 * 4 + 4 * 16 + 16 * 4)
    assert ("fc2.dw", 16, 8, 4) in shapes and ("qkv.dx", 8, 12, 4) in shapes


def test_the_rate_is_measured_on_one_thread_and_the_thread_count_restored(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(gemm_rate, "MIN_SECONDS", 0.002)  # checked: the thread count, not precision
    threads = torch.get_num_threads()
    result = gemm_rate.measure(tokens=64, hidden=16, ffn=32)
    assert torch.get_num_threads() == threads
    assert result["threads"] == 1 and result["flops_per_s"] > 1e6
    rates = [g["gflops_per_s"] * 1e9 for g in result["gemms"].values()]
    assert min(rates) <= result["flops_per_s"] <= max(rates)
    out = tmp_path / "machine.json"
    assert gemm_rate.main(["--tokens", "64", "--hidden", "16", "--ffn", "32", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["flops_per_s"] > 0
    assert "GFLOP/s (Σ FLOPs / Σ seconds)" in capsys.readouterr().out


def test_a_size_below_one_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        gemm_rate.main(["--hidden", "0"])
    assert "--hidden=0: must be ≥ 1" in capsys.readouterr().err
