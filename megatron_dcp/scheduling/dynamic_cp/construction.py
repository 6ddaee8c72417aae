"""Construction: the samples of one global batch formed into micro-batch drafts.

Two ways to form a plan, both from the pool of samples heaviest first:

- :func:`formed_plan` (levels and buckets): while a sample is *heavy* (it could match the
  pool's mean level only on a CP group whose overhead grows by more than
  ``knobs.heavy_waste``), the heaviest opens a micro-batch of its own level that takes fillers
  from the whole pool; the rest is dealt into buckets of equal work (:func:`equalize_buckets`)
  and each bucket forms one micro-batch, leftovers carried to the next.
- :func:`packed_plan` (packing): each micro-batch opens with the heaviest sample left and takes
  whatever else its tokens hold where its peak grows least (few, full micro-batches: the
  strategy of Megatron dev's greedy scheduler, judged by this cost model).

Each micro-batch is formed by :func:`~.microbatch_forming.form_microbatch`; both end by
dissolving light micro-batches into the others where that pays (``moves.dissolve``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron_dcp.scheduling.balance import lpt_partition
from megatron_dcp.scheduling.draft import KEY, Item
from megatron_dcp.scheduling.dynamic_cp.microbatch_builder import MicroBatchBuilder
from megatron_dcp.scheduling.dynamic_cp.microbatch_forming import (
    fill_level,
    form_microbatch,
    heaviest_first,
)
from megatron_dcp.scheduling.dynamic_cp.microbatch_search import rebalance_microbatch
from megatron_dcp.scheduling.dynamic_cp.moves.dissolve import dissolve_light_microbatches
from megatron_dcp.scheduling.dynamic_cp.rank_repair import fill_empty_ranks
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft


def formed_plan(
    ctx: Context,
    pool: List[Item],
    all_heavy: bool = False,
    extra_buckets: int = 0,
    vpp: Optional[int] = None,
) -> List[MicroBatchDraft]:
    """Micro-batch drafts until every sample of ``pool`` (heaviest first) is
    placed. While a sample is heavy (or always, with ``all_heavy``), the heaviest opens a
    micro-batch of its own level that takes fillers from the whole pool; the rest is split into
    buckets of equal work (``extra_buckets`` more than the tokens need), one micro-batch each,
    leftovers carried to the next. Last, the lightest micro-batches are dissolved into the
    others where that pays (``moves.dissolve``; counts VPP would split again are undone)."""
    drafts: List[MicroBatchDraft] = []
    while pool:
        floor = fill_level(ctx, pool)
        if not (all_heavy or is_heavy(ctx, pool, floor)):
            break
        draft, pool = form_microbatch(ctx, pool, floor)
        drafts.append(draft)
    carry: List[Item] = []
    for bucket in equalize_buckets(ctx, pool, extra_buckets):
        draft, carry = form_microbatch(ctx, heaviest_first(ctx, carry + bucket))
        drafts.append(draft)
    while carry:
        draft, carry = form_microbatch(ctx, carry)
        drafts.append(draft)
    dissolve_light_microbatches(ctx, drafts, vpp)
    return drafts


def packed_plan(ctx: Context, pool: List[Item], vpp: Optional[int] = None) -> List[MicroBatchDraft]:
    """The packing variant of :func:`formed_plan`: each micro-batch opens with the heaviest sample
    left on its smallest CP size an empty micro-batch can hold, fills up to that sample's level,
    then takes whatever else of the pool its tokens hold where the micro-batch's peak grows least
    (few micro-batches, each filled; the strategy of Megatron dev's greedy scheduler, judged by this
    cost model)."""
    drafts: List[MicroBatchDraft] = []
    while pool:
        builder = MicroBatchBuilder(ctx)
        size = next(c for c in ctx.sizes_from(pool[0].min_cp) if ctx.openable(c))
        builder.open(pool[0], size, 0.0)
        rest = builder.fill_from(pool[1:])
        if rest:
            builder.level = float("inf")
            rest = builder.fill_from(rest)
        fill_empty_ranks(ctx, builder.groups, builder.free, rest)
        rebalance_microbatch(ctx, builder.groups)
        drafts.append(builder.groups)
        pool = rest
    dissolve_light_microbatches(ctx, drafts, vpp)
    return drafts


def is_heavy(ctx: Context, pool: Sequence[Item], floor: float) -> bool:
    """True when a sample of ``pool`` (heaviest first) can match the pool's fill level only on a
    CP group so large that its total cost grows by more than ``knobs.heavy_waste``: it needs a
    micro-batch of its own (higher) level instead; ``floor`` is the pool's :func:`fill_level`."""
    alone, limit = ctx.alone, ctx.knobs.heavy * floor
    candidates = pool[: count_costlier(ctx, pool, limit)]
    one_per_key = dict(zip(map(KEY, candidates), candidates)).values()  # the cost key decides
    return any(
        alone(item.key, item.min_cp) > limit
        and promotion_waste(ctx, item, floor) > ctx.knobs.heavy_waste
        for item in one_per_key
    )


def count_costlier(ctx: Context, pool: Sequence[Item], limit: float) -> int:
    """How many samples at the head of ``pool`` (heaviest first) may cost more than ``limit``
    alone on their minimum CP size: a binary search for the first whose cost alone on every
    size up to its minimum is within ``limit``, a bound that never grows along the pool (a
    shorter sample costs less on every size and has no larger minimum)."""
    sizes, low, high = ctx.domain.group_sizes, 0, len(pool)
    while low < high:
        middle = (low + high) // 2
        key, min_cp = pool[middle].key, pool[middle].min_cp
        if max(ctx.alone(key, size) for size in sizes if size <= min_cp) <= limit:
            high = middle
        else:
            low = middle + 1
    return low


def promotion_waste(ctx: Context, item: Item, level: float) -> float:
    """Relative extra total cost of running ``item`` on the smallest CP group where its per-rank
    cost is within ``level`` (the largest group when none is) instead of its minimum."""
    least = ctx.min_work(item)
    if ctx.alone(item.key, item.min_cp) <= level or least <= 0:
        return 0.0
    for size in ctx.sizes_from(item.min_cp):
        if ctx.alone(item.key, size) <= level:
            break
    return ctx.alone(item.key, size) * size / least - 1.0


def equalize_buckets(ctx: Context, pool: Sequence[Item], extra: int = 0) -> List[List[Item]]:
    """Buckets of equal work: LPT of ``pool`` (heaviest first, as :func:`heaviest_first`
    orders it) into the fewest buckets of N × budget tokens its tokens need (more when LPT
    cannot fit them), plus ``extra``, equal least work each; empties dropped."""
    capacity = ctx.domain.size * ctx.domain.budget
    count = max(1, -(-sum(item.seqlen for item in pool) // capacity)) + extra
    buckets = lpt_partition(pool, count, capacity, ctx.min_work, ordered=True)
    while buckets is None:
        count += 1
        buckets = lpt_partition(pool, count, capacity, ctx.min_work, ordered=True)
    return [bucket for bucket in buckets if bucket]
