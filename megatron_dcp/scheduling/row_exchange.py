"""Step 7 of ``default_dynamic_cp``: ``exchange_between_rows`` moves and swaps samples between
micro-batches while that shortens the critical path.

The earlier steps balance each micro-batch on its own; what one micro-batch cannot fix (the
last ones, made of what the others left over, are often heavier or lighter than the rest) an
exchange with another can. The critical path is Σ over micro-batches of the peak (the
most-loaded group), so a sample of a micro-batch's *top group* is worth moving when the peak
falls by more than the receiving micro-batch's peak grows, the receiving group taking it within
its token budget and minimum CP size. Two exchanges are tried, best gain first:

- a **move** of a sample from the top group to another micro-batch's group;
- a **swap** of that sample with a lighter one of another micro-batch's group, which also
  relieves a top group of a single sample, or where no group has room for a move.

When the top group ties with another group of its micro-batch, no single exchange lowers the
peak; with ``ties`` (the last search, on the chosen plan) the exchange of one of its
``TIE_ITEMS`` longest samples that lowers it most while no peak grows is made then (a *tie
break*), and the next search can lower the other.

The micro-batch count, the groups and their blocks never change (VPP alignment and the idle-rank
rule hold), no group is left without a non-empty sample, and each exchange shortens Σ peaks by
at least ``MIN_GAIN`` of a peak or, breaking a tie, keeps every peak and lowers a top group by
that much; the passes are bounded. A pass visits the micro-batches
most-loaded first, each making at most ``EXCHANGE_STEPS`` exchanges; at most
``EXCHANGE_PASSES`` passes, on plans of at most ``EXCHANGE_ROWS`` micro-batches. A receiving
micro-batch offers, per CP size, its least-loaded groups (``SWAP_GROUPS`` of them for swaps):
one exchange search costs O(K · S · s) for K micro-batches, S group sizes and the s samples of
a top group examined (at most ``EXCHANGE_ITEMS``).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.draft import GroupDraft, Item
from megatron_dcp.scheduling.dynamic_cp_context import Context, Row
from megatron_dcp.scheduling.row_refinement import spread

# Exchanges per micro-batch and pass, and passes.
EXCHANGE_STEPS = 4
EXCHANGE_PASSES = 3
# Plans of more micro-batches are left as they are: a search costs O(K) per micro-batch visited,
# so a pass costs O(K²) (the fuzzer's tiny budgets make hundreds of micro-batches).
EXCHANGE_ROWS = 32
# An exchange must lower Σ peaks by at least this fraction of the relieved micro-batch's peak.
MIN_GAIN = 1e-4
# Samples of a top group examined; for swaps, receiving groups per CP size and partner samples
# per receiving group.
EXCHANGE_ITEMS = 6
# Samples of a tied top group examined (longest first) to break the tie.
TIE_ITEMS = 2
SWAP_GROUPS = 2
SWAP_PARTNERS = 2

# (gain, sample of the top group, receiving micro-batch's index, receiving group, its sample
# sent back or None)
Exchange = Tuple[float, Item, int, GroupDraft, Optional[Item]]


class RowView:
    """One micro-batch as exchanges see it: its peak, the highest load of its other groups, the
    most its peak can fall (``cap``), its top group and, per CP size, its groups least-loaded
    first."""

    def __init__(self, row: Row) -> None:
        self.row = row
        ordered = sorted(row, key=lambda g: (g.load, g.block.start))
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
            found = sorted(group.items, key=lambda it: (-it.seqlen, it.sample_id))
            self._partners[id(group)] = found
        return found


def exchange_between_rows(ctx: Context, rows: List[Row], ties: bool = False) -> None:
    """Passes over the micro-batches, most-loaded first, each applying its best exchange while
    one shortens the critical path (at most ``EXCHANGE_STEPS`` per micro-batch and pass, at
    most ``EXCHANGE_PASSES`` passes, ending after a pass without one); plans of more than
    ``EXCHANGE_ROWS`` micro-batches are left alone."""
    if not 2 <= len(rows) <= EXCHANGE_ROWS:
        return
    views = [RowView(row) for row in rows]
    for _ in range(EXCHANGE_PASSES):
        before = sum(view.peak for view in views)
        for index in sorted(range(len(rows)), key=lambda i: (-views[i].peak, i)):
            for _ in range(EXCHANGE_STEPS):
                found = best_exchange(ctx, views, index, ties)
                if found is None:
                    break
                apply(ctx, views[index].top, found)
                other = found[2]
                views[index], views[other] = RowView(rows[index]), RowView(rows[other])
        if sum(view.peak for view in views) >= before:
            return  # a pass that only broke ties ends the search


def best_exchange(
    ctx: Context, views: Sequence[RowView], index: int, ties: bool = False
) -> Optional[Exchange]:
    """The exchange of a sample of micro-batch ``index``'s top group that shortens Σ peaks the
    most (by at least ``MIN_GAIN`` of the peak); None when none does. The top's peak falls by at
    most its *relief* (min(peak − second, the sample's load)), so samples are examined longest
    first until the relief cannot beat the best gain found. With ``ties``, when the top group
    ties with another (no relief), the exchange of its longest samples (``TIE_ITEMS``) that
    lowers it most without raising any peak is made instead: the next search can then lower the
    other."""
    view = views[index]
    floor = view.peak * MIN_GAIN
    tied = ties and view.cap <= floor
    best: Optional[Exchange] = None
    for rank, (item, out, leaves) in enumerate(top_samples(ctx, view)):
        if (out if tied else min(view.cap, out)) <= floor or (tied and rank == TIE_ITEMS):
            break  # shorter samples relieve the top group even less
        for other, receiver in enumerate(views):
            if other == index:
                continue
            for relief, growth, group, back in exchanges(ctx, view, item, out, receiver, leaves):
                gain = relief if tied and growth <= 0.0 else min(view.cap, relief) - growth
                if gain > floor:
                    best, floor = (gain, item, other, group, back), gain
    return best


def top_samples(ctx: Context, view: RowView) -> Iterator[Tuple[Item, float, bool]]:
    """(sample, its per-rank cost on the top group, whether it may leave without a sample in
    exchange) for the samples of ``view``'s top group examined, longest first."""
    top = view.top
    movable = len(top.items) > 1
    for item in spread(view.partners(top), EXCHANGE_ITEMS):
        yield item, ctx.load(item.seqlen, top.size), movable and top.tokens > item.seqlen


def exchanges(
    ctx: Context, view: RowView, item: Item, out: float, receiver: RowView, leaves: bool
) -> Iterator[Tuple[float, float, GroupDraft, Optional[Item]]]:
    """The exchanges of ``item`` (per-rank cost ``out`` on ``view``'s top group) with
    ``receiver``, as (how much the top group's load falls, how much the receiver's peak grows,
    group, sample sent back or None): per CP size that can take it, a move to the least-loaded
    group with room (when ``leaves``: its group keeps a non-empty sample) and swaps with the
    ``SWAP_PARTNERS`` longest shorter samples of the ``SWAP_GROUPS`` least-loaded groups. A
    receiver's peak counts only when it grows (a swap that also lowers it is found from the
    receiver's side)."""
    top, budget, peak = view.top, ctx.domain.budget, receiver.peak
    top_costs = ctx.per_size[top.size]
    for size, groups in receiver.by_size.items():
        if size < item.min_cp:
            continue
        costs = ctx.per_size[size]
        into = costs[item.seqlen]
        if leaves:
            group = next((g for g in groups if size * budget - g.tokens >= item.seqlen), None)
            if group is not None:
                yield out, max(0.0, group.load + into - peak), group, None
        for group in groups[:SWAP_GROUPS]:
            for back in swap_partners(ctx, top, item, group, receiver.partners(group)):
                length = back.seqlen
                growth = max(0.0, group.load + into - costs[length] - peak)
                yield out - top_costs[length], growth, group, back


def swap_partners(
    ctx: Context, top: GroupDraft, item: Item, group: GroupDraft, partners: Sequence[Item]
) -> Iterator[Item]:
    """The (at most ``SWAP_PARTNERS``) longest samples of ``partners`` (``group``'s, longest
    first) shorter than ``item`` that may trade places with it: both within the token budget
    and their minimum CP sizes, ``top`` keeping a non-empty sample."""
    budget = ctx.domain.budget
    room = group.size * budget - group.tokens - item.seqlen
    top_room = top.size * budget - top.tokens + item.seqlen
    found = 0
    for back in partners:
        if back.seqlen >= item.seqlen:
            continue
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
        if found == SWAP_PARTNERS:
            return


def apply(ctx: Context, top: GroupDraft, exchange: Exchange) -> None:
    """Carry out ``exchange`` of a sample of ``top``."""
    _, item, _, group, back = exchange
    top.pop(item, ctx.load(item.seqlen, top.size))
    if back is not None:
        group.pop(back, ctx.load(back.seqlen, group.size))
        top.push(back, ctx.load(back.seqlen, top.size))
    group.push(item, ctx.load(item.seqlen, group.size))
