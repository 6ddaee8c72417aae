"""The polish of batches too large for the whole search (``microbatch_search.polish_imbalanced``,
called by ``plan_search.search_chosen`` on batches of more than ``knobs.search_samples`` and at
most ``knobs.polish_samples`` samples): only micro-batches whose peak exceeds their mean per-rank
load by more than ``knobs.polish_imbalance`` of the peak are polished."""

from dataclasses import replace

from scheduling_strategies import rank_drafts

from megatron_dcp.scheduling import CostModel, Domain
from megatron_dcp.scheduling.dynamic_cp.knobs import Knobs
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import polish_imbalanced
from megatron_dcp.scheduling.dynamic_cp.plan_search import search_chosen
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, peak

LINEAR = CostModel(1.0, 0.0, name="linear")
# Micro-batch 0: loads 110 and 10 (imbalance 50 of 110); micro-batch 1: 102 and 99 (1.5 of
# 102, under 2 %). The polish lowers both peaks (merging each pair into one 2-rank group: 60
# and 100.5).
LAYOUT = [[[100, 10], [10]], [[100, 2], [99]]]


def peaks(drafts):
    return [peak(draft) for draft in drafts]


def test_only_the_imbalanced_micro_batch_is_polished():
    ctx = Context(Domain(2, 1, 1000), LINEAR)
    drafts = rank_drafts(ctx, LAYOUT)
    polish_imbalanced(ctx, drafts)
    assert peaks(drafts) == [60, 102]


def test_a_lower_threshold_polishes_both():
    ctx = Context(Domain(2, 1, 1000), LINEAR, Knobs(polish_imbalance=0.01))
    drafts = rank_drafts(ctx, LAYOUT)
    polish_imbalanced(ctx, drafts)
    assert peaks(drafts) == [60, 100.5]


def test_the_search_polishes_imbalanced_micro_batches_of_batches_up_to_polish_samples():
    knobs = replace(Knobs(), search_samples=2, polish_samples=4)
    ctx = Context(Domain(2, 1, 1000), LINEAR, knobs)
    for samples, expected in ((4, [60, 102]), (5, [110, 102])):
        drafts = rank_drafts(ctx, LAYOUT)
        search_chosen(ctx, drafts, samples, bound=1.0)
        assert peaks(drafts) == expected
