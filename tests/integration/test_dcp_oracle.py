"""End to end on megatron-core (CPU, gloo): a DCP training step through megatron's own pipeline
schedules equals the single-process, no-CP run on the same samples — summed loss and token count
(relative 1e-5) and every gradient (1e-4) — for every layout, with the DCP scheduler and with the
static-CP baseline (``dp_balanced``)."""

from dataclasses import dataclass
from functools import partial
from typing import Optional

import pytest
import torch

from megatron_dcp.integration.megatron_import import import_megatron_core
from megatron_dcp.testing import run_distributed

pytestmark = pytest.mark.skipif(not import_megatron_core(), reason="megatron-core not installed")

from megatron_dcp.testing.dcp_step import (  # noqa: E402
    dcp_training_run,
    dcp_training_step,
    reference_training_run,
)
from megatron_dcp.testing.gpt import (  # noqa: E402
    TinyGPTOptions,
    make_samples,
    single_process_reference,
)
from megatron_dcp.testing.oracle import (  # noqa: E402
    adam_batches,
    assert_step_matches,
    assert_weights_match,
    reference_cache,
)
from megatron_dcp.testing.plan_coverage import Layout, assert_covers  # noqa: E402

# Lengths chosen so that plans mix CP sizes: with budget 64 on N = 4, 200 needs the whole domain,
# 120 and 71 need 2 ranks, the rest fit one rank (test_groups_smaller_and_larger...).
LENGTHS = (37, 5, 120, 64, 9, 200, 33, 71)
OPTIONS = TinyGPTOptions(num_layers=4)


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    cp: int = 2
    vpp: Optional[int] = None
    world: int = 4
    num_layers: int = OPTIONS.num_layers  # a multiple of pp·vpp

    @property
    def options(self) -> TinyGPTOptions:
        return TinyGPTOptions(num_layers=self.num_layers)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def claimed(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, vpp=self.vpp)

    def __str__(self) -> str:
        vpp = f"vpp{self.vpp}" if self.vpp else ""
        return f"tp{self.tp}pp{self.pp}{vpp}dp{self.dp}cp{self.cp}"


LAYOUTS = [
    ParallelLayout(cp=2, world=4),  # dp2·cp2
    ParallelLayout(cp=4, world=8),  # dp2·cp4, N = 8
    ParallelLayout(tp=2, cp=2, world=4),
    ParallelLayout(pp=2, cp=2, world=4),
    ParallelLayout(pp=2, cp=2, world=8),  # pp2·dp2·cp2
    ParallelLayout(tp=2, pp=2, cp=2, world=8),
    ParallelLayout(pp=2, cp=2, vpp=2, world=4),
    ParallelLayout(pp=4, cp=2, world=8),  # one layer per stage
    # 8 chunks of one layer; 4 micro-batches, so stages 0 and 1 run them all in warm-up
    # (test_pipeline_p2p.py: the shape exchange that deadlocked there on gloo).
    ParallelLayout(pp=4, cp=2, vpp=2, world=8, num_layers=8),
]


@pytest.fixture(scope="module")
def samples():
    return make_samples(LENGTHS, OPTIONS.vocab_size, seed=7)


@pytest.fixture(scope="module")
def reference_of(samples):
    return reference_cache(samples)


@pytest.fixture(scope="module")
def reference(reference_of):
    return reference_of(OPTIONS)


def budget_for(layout: ParallelLayout) -> int:
    """A budget that makes the longest sample need the whole domain under DCP, while static CP
    (groups of ``cp``) can still hold it."""
    return max(-(-max(LENGTHS) // layout.cp), -(-max(LENGTHS) // (layout.dp * layout.cp)))


def run_step(layout: ParallelLayout, samples, scheduler: str, budget: int, min_cp_size: int = 1):
    """One DCP step of ``layout.options`` on every rank of the layout."""
    step = partial(
        dcp_training_step,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        vpp=layout.vpp,
        scheduler=scheduler,
        budget=budget,
        min_cp_size=min_cp_size,
        options=layout.options,
    )
    return run_distributed(step, layout.world, samples, timeout_s=240)


@pytest.mark.parametrize("scheduler", ["default_dynamic_cp", "dp_balanced"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_dcp_step_equals_single_process(layout, scheduler, samples, reference_of):
    """DCP plans mixing CP sizes; static CP (``dp_balanced``) on its CP size alone."""
    results = run_step(layout, samples, scheduler, budget_for(layout))
    static = {layout.cp} if scheduler == "dp_balanced" else None
    assert_covers(results, layout.claimed, cp_sizes=static)
    for result in results:
        assert_step_matches(result, reference_of(layout.options))


@pytest.mark.parametrize("min_cp_size", [1, 2])
def test_groups_smaller_and_larger_than_static_cp_in_one_step(min_cp_size, samples, reference):
    """Budget 64 on dp2·cp2: the 200-token sample needs all 4 ranks while the others fit on
    ``min_cp_size`` or 2 ranks, so micro-batches run on groups larger than the static CP group
    of 2 next to smaller or equal ones — an input static CP cannot run at all."""
    layout = ParallelLayout(cp=2, world=4)
    results = run_step(layout, samples, "default_dynamic_cp", 64, min_cp_size)
    assert_covers(results, layout.claimed, mix_of={4})
    for result in results:
        assert_step_matches(result, reference)
        assert min(result.cp_sizes) >= min_cp_size


def test_weights_after_three_adam_steps_equal_single_process():
    """DDP + megatron's Adam, three global batches of different lengths, dp2·cp2: the weights
    equal those of the single-process run (gradient scaling by the global token count). Adam
    turns float noise in near-zero gradients into full-size updates (m/√v), so weights agree to
    1e-4 absolute — each step moves them by up to the learning rate, 1e-2."""
    batches = adam_batches(OPTIONS.vocab_size)
    (expected,) = run_distributed(reference_training_run, 1, batches, OPTIONS, timeout_s=240)
    results = run_distributed(
        partial(dcp_training_run, cp=2, budget=64, options=OPTIONS), 4, batches, timeout_s=240
    )
    assert_covers(results, ParallelLayout(cp=2, world=4).claimed)
    for result in results:
        assert_weights_match(result.weights, expected)


def test_non_power_of_two_domain():
    """dp3·cp2 (N = 6): groups are the aligned blocks of 1, 2 and 4 ranks that fit, plus the
    whole domain; the step still equals the single-process run."""
    six = make_samples((150, 5, 64, 90, 12, 33), OPTIONS.vocab_size, seed=3)
    expected = single_process_reference(six, OPTIONS)
    layout = ParallelLayout(cp=2, world=6)
    results = run_step(layout, six, "default_dynamic_cp", 32)
    assert_covers(results, layout.claimed)
    assert any(size > 2 for size in results[0].cp_sizes)
    for result in results:
        assert_step_matches(result, expected)


def sft_masked(samples):
    """The samples with SFT-like loss masks: a masked prompt, then answer spans separated by a
    masked user turn; one sample wholly masked (a conversation truncated before its answer) and
    one with only its last label in the loss."""
    masked = []
    for index, sample in enumerate(samples):
        length = sample["tokens"].numel()
        mask = torch.zeros(length)
        prompt, turn = length // 3, max(1, length // 5)
        mask[prompt : prompt + turn] = 1
        mask[prompt + 2 * turn :] = 1
        if index == 1:
            mask[:] = 0
        if index == 4:
            mask[:] = 0
            mask[-1] = 1
        masked.append({**sample, "loss_mask": mask})
    return masked


@pytest.mark.parametrize(
    "layout", [ParallelLayout(cp=2, world=4), ParallelLayout(pp=2, cp=2, world=8)], ids=str
)
def test_sft_masks_divide_by_the_assistant_tokens(layout, samples):
    """Only the answer tokens carry loss: the summed loss, the token count it is divided by (the
    global count of assistant tokens) and every gradient equal the single-process run with the
    same masks."""
    masked = sft_masked(samples)
    expected = single_process_reference(masked, layout.options)
    assert expected.num_tokens == sum(int(s["loss_mask"].sum()) for s in masked)
    results = run_step(layout, masked, "default_dynamic_cp", budget_for(layout))
    assert_covers(results, layout.claimed)
    for result in results:
        assert_step_matches(result, expected)
