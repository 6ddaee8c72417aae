"""Megatron dev's packing flags on megatron_dcp (``integration.packing_flags``): each padding of
the packs trains exactly like the single-process, no-CP run on the same samples (summed loss
and every gradient; dropout off), the packs have the shapes the flags promise, the planner keeps
the cap on sequences per pack, and bad values are refused before the first step with the flag
named."""

import argparse
from functools import partial

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.integration.config import DCPConfig  # noqa: E402
from megatron_dcp.integration.packing_flags import (  # noqa: E402
    add_packing_args,
    check_pack_padding,
    pack_padding_from_args,
    padded_cost,
)
from megatron_dcp.runtime.pack_padding import PackPadding  # noqa: E402
from megatron_dcp.runtime.packing import pack_samples, unzigzag  # noqa: E402
from megatron_dcp.scheduling import build_cost_model  # noqa: E402
from megatron_dcp.testing.dcp_step import dcp_training_step  # noqa: E402
from megatron_dcp.testing.gpt import TinyGPTOptions, make_samples  # noqa: E402
from megatron_dcp.testing.oracle import assert_step_matches, reference_cache  # noqa: E402
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
OPTIONS = TinyGPTOptions(num_layers=2)
BUDGET = 64
PADDINGS = {
    "align 8, dummy tail": PackPadding(alignment=8),
    "align to the budget, cap 6": PackPadding(alignment="max", budget=BUDGET, max_sequences=6),
    "align 16, extend last": PackPadding(alignment=16, tail_policy="extend_last"),
    "cap 2, align 8": PackPadding(alignment=8, max_sequences=3),
    "cap 1, no alignment": PackPadding(max_sequences=1),
}


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, OPTIONS.vocab_size, seed=7)


@pytest.fixture(scope="module")
def reference(samples):
    return reference_cache(samples)(OPTIONS)


@pytest.mark.parametrize("name", PADDINGS)
def test_a_padded_step_equals_single_process(name, samples, reference):
    step = partial(
        dcp_training_step, cp=2, budget=BUDGET, options=OPTIONS, pack_padding=PADDINGS[name]
    )
    results = run_distributed(step, 4, samples, timeout_s=240)
    assert_covers(results, Layout(dp=2, cp=2))  # a plan mixing CP sizes
    for result in results:
        assert_step_matches(result, reference)


def pieces(lengths, padding, cp_size=2):
    samples = [
        {"tokens": torch.arange(1, n + 1), "labels": torch.arange(n), "loss_mask": torch.ones(n)}
        for n in lengths
    ]
    return [pack_samples(samples, cp_size, rank, 2 * cp_size, padding) for rank in range(cp_size)]


@pytest.mark.parametrize("alignment", [4, 8, 12])
def test_an_aligned_pack_keeps_its_tokens_in_place(alignment):
    plain = pieces([5, 9, 1], PackPadding())
    for policy in ("append_dummy_seq", "extend_last"):
        padded = pieces([5, 9, 1], PackPadding(alignment=alignment, tail_policy=policy))
        assert all(p.num_local_tokens % alignment == 0 for p in padded)
        whole = unzigzag([p.tokens[0] for p in padded], padded[0].cu_seqlens_padded)
        before = unzigzag([p.tokens[0] for p in plain], plain[0].cu_seqlens_padded)
        assert torch.equal(whole[: before.numel()], before) and not whole[before.numel() :].any()
        assert sum(p.num_tokens for p in padded) == 15


def test_max_pads_every_pack_to_the_budget_and_the_cap_fixes_cu_seqlens():
    packs = pieces([5, 9], PackPadding(alignment="max", budget=24, max_sequences=4))
    assert [p.num_local_tokens for p in packs] == [24, 24]
    assert [p.cu_seqlens.numel() for p in packs] == [5, 5]
    assert packs[0].cu_seqlens.tolist() == [0, 5, 14, 14, 14]


def test_a_pack_over_the_cap_is_refused():
    with pytest.raises(ValueError, match="thd-max-packed-sequences"):
        pieces([5, 9, 3], PackPadding(alignment=8, max_sequences=3))


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_packing_args(parser)
    args = parser.parse_args(list(argv))
    args.max_seqlen_per_dp_cp_rank = BUDGET
    return args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pad-packed-seq-alignment", "12"], "--pad-packed-seq-alignment=12: must be a multiple"),
        (["--pad-packed-seq-alignment", "7"], "e.g. 8, or max"),
        (["--thd-max-packed-sequences", "0"], "--thd-max-packed-sequences=0: must be >= 1"),
        (
            ["--pad-packed-seq-alignment", "8", "--thd-max-packed-sequences", "1"],
            "one slot holds the dummy tail",
        ),
    ],
)
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        padding = pack_padding_from_args(parse(*argv))
        check_pack_padding(padding, BUDGET, tp_size=1, sequence_parallel=False)


def test_argparse_refuses_a_word():
    with pytest.raises(SystemExit):
        parse("--pad-packed-seq-alignment", "most")


def test_the_config_checks_the_alignment_against_the_budget():
    with pytest.raises(ValueError, match="divides --max-seqlen-per-dp-cp-rank=64"):
        DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, pack_padding=PackPadding(alignment=24))
    DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, pack_padding=PackPadding(alignment=32))
    fixed = PackPadding(alignment="max", budget=BUDGET)
    with pytest.raises(ValueError, match="give --thd-max-packed-sequences K too"):
        DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, pack_padding=fixed)
    too_many = PackPadding(alignment="max", budget=BUDGET, max_sequences=40)
    with pytest.raises(ValueError, match="lower the cap or raise the budget"):
        DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, pack_padding=too_many)


def test_the_planner_keeps_the_cap_and_room_for_the_padding():
    padding = PackPadding(alignment="max", budget=BUDGET, max_sequences=3)
    config = DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, cp_size=2, pack_padding=padding)
    scheduler = config.build_scheduler(4)
    assert scheduler.domain.budget == BUDGET - 2 * 2 and scheduler.max_samples_per_group == 2
    plan = scheduler.schedule([3, 5, 7, 1, 2, 9, 4, 6, 8, 1, 1, 2])
    assert max(len(g.sample_ids) for mb in plan.microbatches for g in mb.groups) <= 2


def test_padding_is_counted_in_the_cost():
    cost = build_cost_model("model")
    fixed = padded_cost(cost, PackPadding(alignment="max", budget=BUDGET))
    assert fixed.linear == 0 and fixed.microbatch == cost.microbatch + cost.linear * BUDGET
    aligned = padded_cost(cost, PackPadding(alignment=8))
    assert aligned.microbatch == cost.microbatch + cost.linear * 4
    assert padded_cost(cost, PackPadding()) is cost


def test_the_rl_adapter_refuses_pack_padding():
    from megatron_dcp.adapters import split_batch

    config = DCPConfig(max_seqlen_per_dp_cp_rank=BUDGET, pack_padding=PackPadding(alignment=8))
    with pytest.raises(ValueError, match="the RL adapter packs without pack padding"):
        split_batch([], groups=None, config=config)
