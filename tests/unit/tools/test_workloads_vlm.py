"""The simulator's vision-language workload ``vlm``: its documented mixture, patches drawn with
the lengths from one seed, and ``megatron-dcp simulate --workload vlm`` planning with them."""

import json

from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.tools.cli import main as cli
from megatron_dcp.tools.compare import DomainSpec, evaluate
from megatron_dcp.tools.workloads import (
    IMAGE_TOKENS_PER_TILE,
    PATCHES_PER_TILE,
    REFERENCE_WORKLOADS,
    VLM_WORKLOAD,
    WORKLOADS,
    reference_workload,
    summarize,
)


def test_vlm_samples_follow_the_mixture_and_the_seed():
    lengths, patches = VLM_WORKLOAD.samples(3, count=4000)
    assert (lengths, patches) == VLM_WORKLOAD.samples(3, count=4000)  # deterministic
    assert VLM_WORKLOAD.samples(4, count=50) != VLM_WORKLOAD.samples(3, count=50)
    text = [n for n, p in zip(lengths, patches) if p == 0]
    assert 0.37 < len(text) / len(lengths) < 0.43  # 40 % text-only turns
    assert max(text) <= 4096
    for length, count in zip(lengths, patches):
        tiles = count // PATCHES_PER_TILE
        assert count % PATCHES_PER_TILE == 0 and tiles <= 24 * 4
        assert length >= tiles * IMAGE_TOKENS_PER_TILE + (8 if tiles else 16)
    many = [p // PATCHES_PER_TILE for p in patches if p > 8 * 4 * PATCHES_PER_TILE]
    assert many and max(lengths) <= VLM_WORKLOAD.cp_size * VLM_WORKLOAD.budget  # static CP holds


def test_vlm_batch_is_a_global_batch_of_its_layout():
    lengths, patches = VLM_WORKLOAD.samples(0)
    assert VLM_WORKLOAD.lengths(0) == lengths and VLM_WORKLOAD.patches(0) == patches
    assert sum(lengths) >= VLM_WORKLOAD.total_tokens > sum(lengths[:-1])
    assert "encoder patches" in summarize(lengths, patches)
    assert "encoder patches" not in summarize(lengths)
    assert reference_workload("vlm", WORKLOADS) is VLM_WORKLOAD
    assert VLM_WORKLOAD not in REFERENCE_WORKLOADS  # the benchmark matrix stays text


def test_simulate_vlm_prints_its_table(capsys):
    code = cli.main(["simulate", "--workload", "vlm", "--no-peer", "--num-sequences", "60"])
    out = capsys.readouterr().out
    assert code == 0
    for text in ("workload vlm", "encoder patches", "+ViT-L/14", "default_dynamic_cp", "CP/LB"):
        assert text in out, text


def test_simulate_prices_the_patches(capsys):
    """The figures of the vlm batch include its vision work: the same lengths without patches
    plan a shorter critical path under the same cost model."""
    cli.main(["simulate", "--workload", "vlm", "--no-peer", "--num-sequences", "60", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["total_patches"] > 0
    lengths, patches = VLM_WORKLOAD.samples(0, count=60)
    spec = DomainSpec(VLM_WORKLOAD.dp_size, VLM_WORKLOAD.cp_size, VLM_WORKLOAD.budget)
    cost = build_cost_model("model")
    text = evaluate("t", lengths, spec, ("model", cost), ["default_dynamic_cp"])
    ours = {r["scheduler"]: r for r in data["results"]}["default_dynamic_cp"]
    assert ours["critical_path"] > text.results[0].report.critical_path
