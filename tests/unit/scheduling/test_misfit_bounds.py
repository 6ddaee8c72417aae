"""The filling pass of ``MicroBatchBuilder`` skips samples it knows would miss (``misfit``, see
``MicroBatchBuilder._pass``): after a miss, every length at or above the bound returned by
``_misfit_after`` must miss too. Checked where the bound is made, on copies of the builder: a
sample of each probed length is really tried there and must fit nowhere."""

import copy
from typing import List

from hypothesis import given, settings
from hypothesis import strategies as st
from scheduling_strategies import layouts, lengths, scaled

from megatron_dcp.scheduling import build_cost_model
from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.draft import Item
from megatron_dcp.scheduling.dynamic_cp.microbatch_builder import INF, MicroBatchBuilder
from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import (
    fill_level,
    heaviest_first,
    trial_sizes,
)
from megatron_dcp.scheduling.dynamic_cp.search_state import Context

COSTS = {
    "model": build_cost_model("model"),
    "latency": build_cost_model("latency"),
    "linear": CostModel(1.0, 0.0, name="linear"),
    "attention": CostModel.attention_only(),
}


class CheckedBuilder(MicroBatchBuilder):
    """A builder that, each time it bounds the lengths still worth trying, tries lengths at and
    above the bound on copies of itself and records any that fit; with ``check_reads``, also
    each time the pass reads the bound to skip or try a sample (so a bound kept past a
    placement that voids it is caught too)."""

    def __init__(self, ctx: Context, check_reads: bool = False) -> None:
        self.check_reads, self.probing = check_reads, False
        super().__init__(ctx)
        self.wrong: List[tuple] = []
        self.kinds = set()  # "tokens" / "load": bounds below the missed length, by their kind

    def _misfit_after(self, item: Item) -> int:
        bound = super()._misfit_after(item)
        if bound < item.seqlen:
            self.kinds.add("tokens" if self.misfit_by_tokens else "load")
        for seqlen in sorted({bound, bound + 1, (bound + item.seqlen) // 2, item.seqlen}):
            if bound <= seqlen <= self.ctx.domain.max_tokens_per_sequence and self._fits(seqlen):
                self.wrong.append((item.seqlen, bound, seqlen))
        return bound

    @property
    def misfit(self) -> float:
        bound = self._misfit
        if (
            self.check_reads
            and not self.probing
            and bound < self.ctx.domain.max_tokens_per_sequence
        ):
            for seqlen in (bound, bound + 1):
                if seqlen <= self.ctx.domain.max_tokens_per_sequence and self._fits(seqlen):
                    self.wrong.append(("read", bound, seqlen))
        return bound

    @misfit.setter
    def misfit(self, value: float) -> None:
        self._misfit = value

    def _fits(self, seqlen: int) -> bool:
        self.probing = True
        try:
            trial = copy.deepcopy(self)
        finally:
            self.probing = False
        probe = Item(-1, seqlen, self.ctx.domain.cp_degree(seqlen))
        if trial.level == INF:
            return trial._place_lowest(probe)
        return trial._place_under_level(probe)


def fill_checked(ctx: Context, seqlens: List[int], check_reads: bool = False) -> CheckedBuilder:
    """Open a micro-batch with the heaviest sample on its first trial size and fill it from the
    rest, as ``build_trial`` does."""
    items = [Item(i, n, ctx.domain.cp_degree(n)) for i, n in enumerate(seqlens)]
    pool = heaviest_first(ctx, items)
    floor = fill_level(ctx, pool)
    builder = CheckedBuilder(ctx, check_reads)
    builder.open(pool[0], trial_sizes(ctx, pool[0], floor)[0], floor)
    builder.fill_from(pool[1:])
    return builder


@settings(max_examples=scaled(150), deadline=None)
@given(layout=layouts(), data=st.data(), cost=st.sampled_from(sorted(COSTS)))
def test_lengths_at_or_above_a_misfit_bound_fit_nowhere(layout, data, cost):
    dp, cp, budget, min_cp, _ = layout
    cap = dp * cp * budget
    lengths_drawn = data.draw(lengths(cap, budget, 2, 60))
    check_bounds(layout, [min(n, cap) for n in lengths_drawn], cost)  # tiny ones may exceed cap


def check_bounds(layout, seqlens: List[int], cost: str) -> None:
    dp, cp, budget, min_cp, _ = layout
    builder = fill_checked(Context(Domain(dp, cp, budget, min_cp), COSTS[cost]), seqlens, True)
    assert not builder.wrong, builder.wrong


def test_a_one_rank_domain_with_the_longest_sequences():
    check_bounds((1, 1, 1, 1, None), [0, 1], "attention")


def test_bounds_are_made_and_checked_on_a_crowded_micro_batch():
    """The property above is not vacuous: on 64 ranks with many more samples than fit, the
    builder bounds misses under a level, by load and by token room, and each bound holds."""
    domain = Domain(16, 4, 512)
    seqlens = [(37 * i) % 1500 + 1 for i in range(2000)]
    kinds = set()
    for cost in COSTS.values():
        builder = fill_checked(Context(domain, cost), seqlens)
        assert not builder.wrong
        kinds |= builder.kinds
    assert kinds == {"tokens", "load"}
