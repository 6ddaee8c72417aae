"""Construction of one micro-batch: samples heaviest first (``heaviest_first``), and one
micro-batch formed from a pool of samples (``form_microbatch``).

The heaviest sample opens the micro-batch on a CP group of one of a few sizes (``trial_sizes``),
which sets the *level* (its per-rank cost, at least ``fill_level``). Every other sample, heaviest
first and then lightest first to top up, takes a fresh block of the smallest CP size whose cost fits
under the level, or joins the least-loaded group where it fits (placing with
``microbatch_builder.MicroBatchBuilder``). The trial (``build_trial``) with the best ``efficiency``
wins; idle ranks are filled and the micro-batch rebalanced (``rank_repair``, ``microbatch_search``).
"""

from __future__ import annotations

from itertools import chain
from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.draft import KEY, SAMPLE_ID, SEQLEN, Item, longest_first
from megatron_dcp.scheduling.dynamic_cp.microbatch_builder import MicroBatchBuilder
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import rebalance_microbatch
from megatron_dcp.scheduling.dynamic_cp.rank_repair import fill_empty_ranks
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft, peak


def heaviest_first(ctx: Context, items: Sequence[Item]) -> List[Item]:
    """Samples by decreasing least total work, then id (deterministic). Without vision work the
    least total work grows strictly with the length (the minimum CP size never falls as the
    length grows, and a sequence's total cost never falls as its CP size grows), so the order is
    that of decreasing length; with it, the work (``ctx.work``, vision included) orders them."""
    if not ctx.vision:
        return longest_first(list(items))
    ordered = sorted(items, key=SAMPLE_ID)
    ordered.sort(key=lambda item: ctx.work[item.key], reverse=True)
    return ordered


def form_microbatch(
    ctx: Context, pool: Sequence[Item], floor: Optional[float] = None
) -> Tuple[MicroBatchDraft, List[Item]]:
    """Form one micro-batch from ``pool`` (heaviest first; non-empty; ``floor`` its
    :func:`fill_level` when known). Returns its groups, which partition the domain with no idle
    rank, and the samples left for later micro-batches."""
    tokens = sum(map(SEQLEN, pool))
    floor = fill_level(ctx, pool, tokens) if floor is None else floor
    last = tokens <= ctx.domain.size * ctx.domain.budget
    best: Optional[Tuple[float, MicroBatchDraft, List[Item]]] = None
    for size in trial_sizes(ctx, pool[0], floor):
        groups, leftovers = build_trial(ctx, pool, size, floor, last)
        score = efficiency(ctx, groups)
        if best is None or better_trial(ctx, (score, len(leftovers)), (best[0], len(best[2]))):
            best = (score, groups, leftovers)
        if score >= ctx.knobs.good_efficiency:
            break
    assert best is not None
    rebalance_microbatch(ctx, best[1])
    return best[1], best[2]


def better_trial(ctx: Context, new: Tuple[float, int], old: Tuple[float, int]) -> bool:
    """(efficiency, leftover count) of two trials: higher efficiency wins; within
    ``knobs.score_tie``, fewer leftovers (fewer micro-batches)."""
    if abs(new[0] - old[0]) <= ctx.knobs.score_tie:
        return new[1] < old[1]
    return new[0] > old[0]


def build_trial(
    ctx: Context, pool: Sequence[Item], size: int, floor: float, last: bool
) -> Tuple[MicroBatchDraft, List[Item]]:
    """One trial of :func:`form_microbatch`: ``pool[0]`` opens on ``size`` ranks, the rest fills up
    to the level (the ``last`` micro-batch may absorb what is left), and idle ranks are filled."""
    builder = MicroBatchBuilder(ctx)
    builder.open(pool[0], size, floor)
    leftovers = builder.fill_from(pool[1:])
    if last and leftovers:
        leftovers = absorb_leftovers(ctx, builder, leftovers)
    fill_empty_ranks(ctx, builder.groups, builder.free, leftovers)
    return builder.groups, leftovers


def absorb_leftovers(ctx: Context, builder: MicroBatchBuilder, leftovers: List[Item]) -> List[Item]:
    """The last micro-batch places its leftovers above the level when that costs less than the extra
    micro-batch they would need, give or take ``knobs.last_slack`` of the peak: one micro-batch
    fewer is worth that much. Returns the samples still left."""
    extra = extra_microbatch_cost(ctx, leftovers)
    limit = peak(builder.groups) * (1 + ctx.knobs.last_slack) + extra
    builder.level, builder.journal = float("inf"), []
    rest = builder.fill_from(leftovers)
    if peak(builder.groups) > limit:
        builder.undo()
        return leftovers
    return rest


def extra_microbatch_cost(ctx: Context, items: Sequence[Item]) -> float:
    """A lower bound of what a micro-batch holding ``items`` costs: its fixed cost plus the
    larger of their mean work per rank and the least per-rank cost of the heaviest alone (on
    any CP size its ring steps included; without vision work the longest is the heaviest on
    every size, with the fewest sizes to choose from; with it, the most of each sample's least)."""
    if ctx.vision:
        alone = max(min(ctx.alone(i.key, s) for s in ctx.sizes_from(i.min_cp)) for i in items)
    else:
        longest = max(items, key=SEQLEN)
        alone = min(ctx.alone(longest.key, s) for s in ctx.sizes_from(longest.min_cp))
    mean = sum(map(ctx.min_work, items)) / ctx.domain.size
    return max(mean, alone) + ctx.cost.microbatch


def fill_level(ctx: Context, pool: Sequence[Item], tokens: Optional[int] = None) -> float:
    """The mean per-rank cost of a micro-batch if ``pool`` (of ``tokens`` tokens, when known)
    filled the fewest micro-batches its tokens need: the level every micro-batch fills up to (a
    heavier opening sample raises it)."""
    tokens = sum(map(SEQLEN, pool)) if tokens is None else tokens
    total = sum(map(ctx.work.__getitem__, map(KEY, pool)))
    count = max(1, -(-tokens // (ctx.domain.size * ctx.domain.budget)))
    return total / (ctx.domain.size * count)


def trial_sizes(ctx: Context, item: Item, floor: float) -> List[int]:
    """CP sizes to try for the sample that opens a micro-batch, best guess first: the smallest
    size an empty micro-batch can hold whose per-rank cost is within ``floor`` (or the cheapest
    per rank), then smaller ones, which raise the level (at most ``knobs.trials``)."""
    sizes: List[int] = []
    for size in ctx.sizes_from(item.min_cp):
        if not ctx.openable(size):
            continue
        if sizes and ctx.alone(item.key, size) >= ctx.alone(item.key, sizes[-1]):
            break
        sizes.append(size)
        if ctx.alone(item.key, size) <= floor:
            break
    return sizes[::-1][: ctx.knobs.trials]


def efficiency(ctx: Context, draft: MicroBatchDraft) -> float:
    """Useful work of a micro-batch (each sample at its minimum CP size) over N × its max rank
    cost: 1 for a perfectly balanced micro-batch without extra CP overhead."""
    top = peak(draft)
    if top <= 0:
        return 1.0
    items = chain.from_iterable(group.items for group in draft)
    useful = sum(map(ctx.work.__getitem__, map(KEY, items)))
    return useful / (ctx.domain.size * top)
