"""Across the plan: **relocate** and **swap** samples between micro-batches while that shortens
the critical path (:class:`Relocate`), and **tie-break** (:class:`TieBreak`): moves of the plan
driver (``plan_search.improve_plan``).

Construction and the search inside a micro-batch balance each micro-batch on its own; what one
micro-batch cannot fix (the last ones, made of what the others left over, are often heavier or
lighter than the rest) an exchange with another can. The critical path is Σ over micro-batches of
the peak (the most-loaded group), so a sample of a micro-batch's *top group* is worth moving when
the peak falls by more than the receiving micro-batch's peak grows, the receiving group taking it
within its token budget and minimum CP size. Two exchanges are tried, best gain first:

- a **move** of a sample from the top group to another micro-batch's group;
- a **swap** of that sample with a lighter one of another micro-batch's group, which also
  relieves a top group of a single sample, or where no group has room for a move.

When the top group ties with another group of its micro-batch, no single exchange lowers the
peak; the tie-break (the last search, on the chosen plan) makes then the exchange of one of its
``knobs.tie_items`` longest samples that lowers it most while no peak grows, and the next search
can lower the other.

The micro-batch count, the groups and their blocks never change (VPP alignment and the idle-rank
rule hold), no group is left without a non-empty sample, and each exchange shortens Σ peaks by
more than ``knobs.min_gain`` of the peak it lowers or, breaking a tie, keeps every peak and lowers
a top group by that much. The driver visits the micro-batches most-loaded first, each making at
most ``knobs.exchange_steps`` exchanges per pass; at most ``knobs.exchange_passes`` passes, on
plans of at most ``knobs.search_microbatches`` micro-batches. A receiving micro-batch offers, per
CP size, its least-loaded groups (``knobs.swap_groups`` of them for swaps): one exchange search
costs O(K · S · s) for K micro-batches, S group sizes and the s samples of a top group examined
(at most ``knobs.exchange_items``).
"""

from __future__ import annotations

from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.draft import GroupDraft, Item, longest_first
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import (
    PlanCandidate,
    heaviest_on,
    lighter,
    spread,
    transfer,
)
from megatron_dcp.scheduling.dynamic_cp.search_state import (
    Context,
    MicroBatchDraft,
    min_plan_gain,
    most_loaded_first,
    searchable,
)

# (gain, sample of the top group, receiving micro-batch's index, receiving group, its sample
# sent back or None)
Exchange = Tuple[float, Item, int, GroupDraft, Optional[Item]]


class DraftView:
    """One micro-batch as exchanges see it: its peak, the highest load of its other groups, the
    most its peak can fall (``cap``), its top group and, per CP size, its groups least-loaded
    first."""

    def __init__(self, draft: MicroBatchDraft) -> None:
        self.draft = draft
        ordered = sorted(draft, key=lambda g: (g.load, g.block.start))
        self.top = ordered[-1]
        self.peak = self.top.load
        self.second = ordered[-2].load if len(ordered) > 1 else 0.0
        self.cap = self.peak - self.second
        self.by_size: Dict[int, List[GroupDraft]] = {}
        for group in ordered:
            self.by_size.setdefault(group.size, []).append(group)
        self._partners: Dict[int, List[Item]] = {}

    def partners(self, group: GroupDraft) -> List[Item]:
        """``group``'s samples, longest first (memoised: swap partners)."""
        found = self._partners.get(id(group))
        if found is None:
            found = longest_first(list(group.items))
            self._partners[id(group)] = found
        return found


class Relocate:
    """Relocate and swap as a move of the plan driver (``plan_search.improve_plan``): at
    micro-batch ``index``, its best exchange (:func:`best_exchange`); at most
    ``knobs.exchange_steps`` per micro-batch and pass, ``knobs.exchange_passes`` passes, the
    micro-batches most-loaded first; plans of more than ``knobs.search_microbatches``
    micro-batches get no pass. The views of the two micro-batches an exchange touches are made
    again after it, the others' kept."""

    ties = False  # break ties (:class:`TieBreak`)
    restart = False

    def __init__(self, ctx: Context, drafts: List[MicroBatchDraft]) -> None:
        self.ctx, self.drafts = ctx, drafts
        self.views = [DraftView(draft) for draft in drafts]
        self.passes = ctx.knobs.exchange_passes if searchable(ctx, drafts) else 0
        self.steps = ctx.knobs.exchange_steps

    def order(self) -> List[int]:
        """Most-loaded first."""
        return most_loaded_first(self.drafts)

    def find(self, index: int) -> Optional[PlanCandidate]:
        """Micro-batch ``index``'s best exchange, weighed against its peak."""
        found = best_exchange(self.ctx, self.views, index, self.ties)
        if found is None:
            return None
        gain, item, other, group, back = found
        exchange = partial(self.exchange, index, item, other, group, back)
        return PlanCandidate(gain, (self.views[index].peak,), exchange)

    def exchange(
        self, index: int, item: Item, other: int, group: GroupDraft, back: Optional[Item]
    ) -> None:
        """Send ``item`` from micro-batch ``index``'s top group to ``group`` of micro-batch
        ``other`` (with ``back`` in return: a swap)."""
        transfer(self.ctx, self.views[index].top, item, group, back)
        self.views[index] = DraftView(self.drafts[index])
        self.views[other] = DraftView(self.drafts[other])


class TieBreak(Relocate):
    """Relocate and swap, and where a top group ties with another, the tie-break (the last
    search, on the chosen plan)."""

    ties = True


def best_exchange(
    ctx: Context, views: Sequence[DraftView], index: int, ties: bool = False
) -> Optional[Exchange]:
    """The exchange of a sample of micro-batch ``index``'s top group that shortens Σ peaks the most
    (by at least ``knobs.min_gain`` of the peak); None when none does. The top's peak falls by at
    most its *relief* (min(peak − second, the sample's load)), so samples are examined longest first
    until the relief cannot beat the best gain found. With ``ties``, when the top group ties with
    another (no relief), the exchange of its longest samples (``knobs.tie_items``) that lowers it
    most without raising any peak is made instead: the next search can then lower the other."""
    view = views[index]
    floor = min_plan_gain(ctx, view.peak)
    tied = ties and view.cap <= floor
    best: Optional[Exchange] = None
    for rank, (item, out, leaves) in enumerate(top_samples(ctx, view)):
        if (out if tied else min(view.cap, out)) <= floor or (tied and rank == ctx.knobs.tie_items):
            break  # shorter samples relieve the top group even less
        for other, receiver in enumerate(views):
            if other == index:
                continue
            for relief, growth, group, back in exchanges(ctx, view, item, out, receiver, leaves):
                gain = relief if tied and growth <= 0.0 else min(view.cap, relief) - growth
                if gain > floor:
                    best, floor = (gain, item, other, group, back), gain
    return best


def top_samples(ctx: Context, view: DraftView) -> Iterator[Tuple[Item, float, bool]]:
    """(sample, its per-rank cost on the top group, whether it may leave without a sample in
    exchange) for the samples of ``view``'s top group examined, longest first."""
    top = view.top
    movable = len(top.items) > 1
    ordered = heaviest_on(ctx, list(top.items), top.size) if ctx.vision else view.partners(top)
    for item in spread(ordered, ctx.knobs.exchange_items):
        yield item, ctx.load(item.key, top.size), movable and top.tokens > item.seqlen


def exchanges(
    ctx: Context, view: DraftView, item: Item, out: float, receiver: DraftView, leaves: bool
) -> Iterator[Tuple[float, float, GroupDraft, Optional[Item]]]:
    """The exchanges of ``item`` (per-rank cost ``out`` on ``view``'s top group) with ``receiver``,
    as (how much the top group's load falls, how much the receiver's peak grows, group, sample sent
    back or None): per CP size that can take it, a move to the least-loaded group with room (when
    ``leaves``: its group keeps a non-empty sample) and swaps with the ``knobs.swap_partners``
    longest shorter samples of the ``knobs.swap_groups`` least-loaded groups. A receiver's peak
    counts only when it grows (a swap that also lowers it is found from the receiver's side)."""
    top, budget, peak = view.top, ctx.domain.budget, receiver.peak
    top_costs = ctx.per_size[top.size]
    for size, groups in receiver.by_size.items():
        if size < item.min_cp:
            continue
        costs = ctx.per_size[size]
        into = costs[item.key]
        if leaves:
            group = next((g for g in groups if size * budget - g.tokens >= item.seqlen), None)
            if group is not None:
                yield out, max(0.0, group.load + into - peak), group, None
        for group in groups[: ctx.knobs.swap_groups]:
            for back in swap_partners(ctx, top, item, group, receiver.partners(group)):
                growth = max(0.0, group.load + into - costs[back.key] - peak)
                yield out - top_costs[back.key], growth, group, back


def swap_partners(
    ctx: Context, top: GroupDraft, item: Item, group: GroupDraft, partners: Sequence[Item]
) -> Iterator[Item]:
    """The (at most ``knobs.swap_partners``) longest samples of ``partners`` (``group``'s, longest
    first) shorter than ``item`` that may trade places with it: both within the token budget
    and their minimum CP sizes, ``top`` keeping a non-empty sample."""
    budget = ctx.domain.budget
    room = group.size * budget - group.tokens - item.seqlen
    top_room = top.size * budget - top.tokens + item.seqlen
    found = 0
    for back in partners:
        if back.seqlen >= item.seqlen and not (ctx.vision and lighter(ctx, back, item, top.size)):
            continue  # with vision work, a sample at least as long may still be the lighter
        if room + back.seqlen < 0:
            return  # shorter partners leave even less room
        if (
            back.seqlen > top_room
            or back.min_cp > top.size
            or top.tokens - item.seqlen + back.seqlen <= 0  # ``top`` left without work
        ):
            continue
        yield back
        found += 1
        if found == ctx.knobs.swap_partners:
            return
