"""The cost model's fixed cost per sequence (``CostModel.sequence``): what every rank of a CP
group pays for each sequence of its pack whatever its length (the CPU backend's unfused THD
RoPE and reference attention loop over a pack's sequences; docs/performance.md, "The missing
term: a cost per sequence").

Checked: the term is priced for every rank of a group; the CPU profile carries the measured
coefficient and the GPU profiles none; the fit's features count sequences, so that the features
and the cost model agree; a profile file keeps it (and one written before it reads as none);
and the planner uses it: under a world that has the term, the plans chosen with it beat those
chosen without it on conversation-like batches."""

import math
import random
from dataclasses import replace

import pytest

from megatron_dcp.scheduling import CostModel, build_scheduler
from megatron_dcp.scheduling.cost_fit import (
    FEATURES,
    CostProfile,
    coefficients,
    from_coefficients,
    group_features,
    load_profile,
    predict,
    rank_features,
    save_profile,
)
from megatron_dcp.scheduling.hardware import HARDWARE_PROFILES, hardware_profile
from megatron_dcp.scheduling.cost import build_cost_model
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
from megatron_dcp.scheduling.model_shape import ModelShape

# The GPT of the benchmarks (2 layers, hidden 128, 4 heads, FFN 512).
SHAPE = ModelShape(
    hidden_size=128,
    ffn_hidden_size=512,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=4,
    vocab_size=1024,
)
CPU = CostModel.from_model_shape(SHAPE, hardware_profile("cpu-gloo"))


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_every_rank_of_a_group_pays_each_sequence_of_its_pack(cp_size):
    lengths = [96, 200, 33, 512, 7]
    without = replace(CPU, sequence=0.0)
    extra = CPU.group_cost(lengths, cp_size) - without.group_cost(lengths, cp_size)
    assert extra == pytest.approx(len(lengths) * CPU.sequence, rel=1e-12)
    assert CPU.group_cost([], cp_size) == 0.0


def test_the_cpu_profile_measures_it_and_gpu_profiles_have_none():
    """0.49 ms per sequence and attention pass (forward or backward): 4 passes for 2 layers."""
    assert hardware_profile("cpu-gloo").sequence_pass_overhead == pytest.approx(0.49e-3)
    assert CPU.sequence == pytest.approx(4 * 0.49e-3)
    for name, profile in HARDWARE_PROFILES.items():
        if name != "cpu-gloo":
            assert profile.sequence_pass_overhead == 0.0, name
            assert CostModel.from_model_shape(SHAPE, profile).sequence == 0.0, name


@pytest.mark.parametrize("cp_size", [1, 2])
def test_features_count_sequences_and_price_as_the_model(cp_size):
    lengths = [64, 1500, 300]
    row = group_features(lengths, cp_size, spill_elements=CPU.spill_elements)
    assert row[FEATURES.index("sequence")] == len(lengths)
    priced = predict(coefficients(CPU), row)
    assert priced == pytest.approx(CPU.group_cost(lengths, cp_size), rel=1e-12)
    back = from_coefficients(coefficients(CPU), spill_elements=CPU.spill_elements)
    assert back.sequence == CPU.sequence


def test_a_profile_keeps_the_term_and_an_older_one_reads_as_none(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(str(path), CostProfile(CPU, {"by": "test"}))
    assert load_profile(str(path)).cost.sequence == CPU.sequence
    text = path.read_text().replace('"sequence"', '"unused"')
    path.write_text(text)
    assert load_profile(str(path)).cost.sequence == 0.0


def conversation_batches(count: int = 12, size: int = 32, seed: int = 3):
    """Global batches of conversation-like lengths: many short, a few long (≤ 1024)."""
    rng = random.Random(seed)
    return [
        [min(1024, max(16, int(rng.lognormvariate(math.log(120), 0.9)))) for _ in range(size)]
        for _ in range(count)
    ]


@pytest.mark.parametrize("dp,cp,budget", [(1, 2, 512), (1, 4, 256), (2, 4, 256)])
def test_plans_chosen_with_the_term_beat_plans_chosen_without_it(dp, cp, budget):
    """The world has the term (the CPU profile); one planner sees it, the other plans with
    the same model less the term. Summed over the batches, the first one's plans are faster
    in that world, by at least 0.5 %."""
    blind = replace(CPU, sequence=0.0)
    totals = {}
    for name, cost in (("sees", CPU), ("blind", blind)):
        scheduler = build_scheduler(
            "default_dynamic_cp", dp_size=dp, cp_size=cp, max_seqlen_per_dp_cp_rank=budget,
            cost_model=cost,
        )  # fmt: skip
        plans = [scheduler.schedule(batch) for batch in conversation_batches()]
        totals[name] = sum(critical_path(plan, CPU) for plan in plans)
    assert totals["sees"] < totals["blind"] / 1.005, totals


def test_rank_features_of_a_plan_count_every_sequence_at_every_rank_of_its_group():
    scheduler = build_scheduler(
        "dp_balanced", dp_size=1, cp_size=2, max_seqlen_per_dp_cp_rank=512, cost_model=CPU
    )
    batch = conversation_batches(count=1)[0]
    rows = rank_features(scheduler.schedule(batch))
    assert [row[FEATURES.index("sequence")] for row in rows] == [len(batch)] * 2


def test_the_lower_bound_holds_when_tiny_sequences_cost_more_than_their_tokens():
    """Found by the fuzzer: a half-domain sample beside seven tiny ones (three empty). The idle
    bound capped the other half's load by its tokens; seven sequences' fixed costs exceed it."""
    cost = replace(build_cost_model(), sequence=0.00036423013623458037)
    scheduler = build_scheduler(
        "default_dynamic_cp", dp_size=1, cp_size=4, max_seqlen_per_dp_cp_rank=64, min_cp_size=2,
        cost_model=cost,
    )  # fmt: skip
    plan = scheduler.schedule([65, 3, 0, 0, 2, 2, 0, 2])
    assert lower_bound(plan, cost) <= critical_path(plan, cost) * (1 + 1e-12)


def test_the_simulator_has_a_world_with_the_term():
    """``--cost-model cpu`` (simulate, benchmark): the reference model on the CPU profile."""
    cpu, gpu = build_cost_model("cpu"), build_cost_model("model")
    assert cpu.name == "cpu" and cpu.sequence > 0 and gpu.sequence == 0
    assert cpu.sequence == pytest.approx(2 * 32 * 0.49e-3)  # 32 attention layers, fwd + bwd
