"""``calibrate --link-rate``'s pieces that need no namespace: the flag left out of the command run
inside the shaped namespace, and the link figures the profile records from the probe's report
(each rank's share of the one loopback bucket, the bandwidth the fitted comm implies)."""

import json
from types import SimpleNamespace

import pytest

from megatron_dcp.scheduling import CostModel
from megatron_dcp.integration.model_cost import model_shape_from_args
from megatron_dcp.tools.calibration.shaped_link import (
    LINK_REPORT_VARIABLE,
    describe_link,
    link_source,
    without_link_rate,
)

ARGS = SimpleNamespace(hidden_size=128, num_attention_heads=4, num_layers=2, ffn_hidden_size=512)


def test_the_inner_command_has_no_link_rate():
    argv = ["--output", "p.json", "--link-rate", "80mbit", "--hidden-size", "128"]
    assert without_link_rate(argv) == ["--output", "p.json", "--hidden-size", "128"]
    assert without_link_rate(["--link-rate=1gbit", "--nproc", "2"]) == ["--nproc", "2"]


def test_the_profile_records_the_probe_and_what_the_fit_implies(tmp_path, monkeypatch):
    report = {"requested": "80mbit", "requested_bytes_per_s": 1e7, "probed_bytes_per_s": 1.01e7}
    (tmp_path / "link.json").write_text(json.dumps(report))
    kv_bytes = model_shape_from_args(ARGS).kv_bytes(4)  # fp32, all of it exposed on CPU
    assert kv_bytes == 3 * 2 * 2 * 128 * 4  # 3 passes × 2 layers × K and V × 128 × 4 bytes
    cost = CostModel(1e-5, 1e-8, comm=kv_bytes / 4.6e6)
    assert link_source(cost, ARGS, 2) is None  # not inside a shaped calibration
    monkeypatch.setenv(LINK_REPORT_VARIABLE, str(tmp_path / "link.json"))
    figures = link_source(cost, ARGS, 2)
    assert figures["per_rank_bytes_per_s"] == pytest.approx(1.01e7 / 2)
    assert figures["fitted_bytes_per_s"] == pytest.approx(4.6e6)
    assert "probed 10.1 MB/s, 5.0 MB/s per rank" in describe_link(figures)
    assert link_source(CostModel(1e-5, 1e-8), ARGS, 2)["fitted_bytes_per_s"] is None
