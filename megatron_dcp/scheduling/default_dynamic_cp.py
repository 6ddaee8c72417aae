"""``default_dynamic_cp``: the DCP scheduler.

The objective is the critical path Σ_micro-batch (max_rank cost + the fixed micro-batch cost).
Micro-batches may differ in load; what costs time is imbalance *inside* a micro-batch, CP
overhead (each group's ring steps, carried from its first sample, included) and micro-batches
beyond the fewest. Steps (each a named function):

1. ``heaviest_first``    – order the samples by least total work (cost at their minimum CP size).
2. ``plan_rows``         – while ``is_heavy`` (a sample could match the mean level only on a CP
                           group whose overhead exceeds ``HEAVY_WASTE``), ``next_hdp_group`` forms
                           a micro-batch from the whole pool; the rest goes through
                           ``equalize_buckets`` (LPT into the fewest buckets of N × budget tokens,
                           equal work) and one ``next_hdp_group`` per bucket, leftovers carried
                           on; ``row_dissolving.dissolve_light_rows`` then empties light tail
                           micro-batches into the others where that pays.
3. ``next_hdp_group``    – one micro-batch: the heaviest sample opens it on a CP group of one of a
                           few sizes (``trial_sizes``), which sets the *level* (its per-rank cost,
                           at least ``fill_level``). Every other sample, heaviest first and then
                           lightest first to top up, takes a fresh block of the smallest CP size
                           whose cost fits under the level, or joins the least-loaded group where
                           it fits (any size ≥ its minimum: a short sequence may get a larger
                           group). The trial (``build_trial``, placing with
                           ``microbatch_builder.MicroBatchBuilder``) with the best ``efficiency``
                           wins.
4. ``fill_empty_ranks``  – no rank idle: a free block takes a sample from a group holding several,
                           or merges with its neighbours into the parent block (``row_refinement``).
5. ``rebalance_row``     – bounded refinement: move samples out of the most-loaded group into
                           lighter ones while that lowers the micro-batch's maximum
                           (``row_refinement``).
6. ``align_to_vpp``      – split micro-batches until the count is a multiple of the VPP group size
                           (or fall back to whole-domain micro-batches when there are too many);
                           ``aligned_plans`` also re-plans with as many more buckets as needed.

Batches of at most ``SEARCH_SAMPLES`` samples, and plans VPP alignment would split (either with
at most ``SEARCH_ROWS`` micro-batches), also try step 2 with every micro-batch formed from the
whole pool and the packing variant (``packed_rows``), and keep the best plan (``plan_rank``, by
``draft_critical_path``). Cost: each micro-batch scans its pool once per trial (``MicroBatchBuilder`` stops a pass after ``FAIL_LIMIT``
consecutive misses once no rank is free), with one heap of groups per CP size: O(K · T · n log N)
for K micro-batches, T ≤ ``TRIALS`` trials and n samples. Every step takes the shared
``dynamic_cp_context.Context`` (domain, cost model, memoised costs).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.balance import lpt_partition
from megatron_dcp.scheduling.draft import GroupDraft, Item, freeze_microbatch
from megatron_dcp.scheduling.dynamic_cp_context import Context, Row
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.metrics import fluid_lower_bound
from megatron_dcp.scheduling.microbatch_builder import MicroBatchBuilder
from megatron_dcp.scheduling.plan import MicroBatch
from megatron_dcp.scheduling.registry import Scheduler
from megatron_dcp.scheduling.row_dissolving import dissolve_light_rows
from megatron_dcp.scheduling.row_refinement import fill_empty_ranks, rebalance_row

# A sample is heavy (opens a micro-batch of its own level) when it costs more per rank than
# HEAVY × the mean level and reaching that level would cost it HEAVY_WASTE more CP overhead.
HEAVY = 1.25
HEAVY_WASTE = 0.02
# CP sizes tried for the sample that opens a micro-batch, and the efficiency that ends the trials.
TRIALS = 3
GOOD_EFFICIENCY = 0.965
# Trials whose efficiencies differ by at most this much tie (then fewer leftovers win).
SCORE_TIE = 1e-4
# The last micro-batch may exceed its level by this fraction to save one more micro-batch.
LAST_SLACK = 0.02
# Batches of at most this many samples (and plans of at most this many micro-batches) also try
# the all-levels and packing variants of ``plan_rows``.
SEARCH_SAMPLES = 512
SEARCH_ROWS = 32
# A plan within this factor of the lower bound is good enough: then fewer micro-batches win.
GOOD_PLAN = 1.02


class DefaultDynamicCPScheduler(Scheduler, name="default_dynamic_cp"):
    """Per-sequence CP sizes, balanced THD micro-batches; see the module docstring."""

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        ctx = Context(self.domain, self.cost_model)
        items = [Item(i, seqlen, self.domain.cp_degree(seqlen)) for i, seqlen in enumerate(seqlens)]
        pool = heaviest_first(ctx, items)
        vpp = self.microbatch_group_size_per_vp_stage
        plans = aligned_plans(ctx, pool, items, vpp, False)
        # Small batches, and plans that VPP alignment would split, also try the all-levels and
        # the packing variants (their own micro-batch counts) unless the plan is long (each
        # variant costs a scan of the pool per micro-batch); the best plan wins.
        if (len(items) <= SEARCH_SAMPLES or len(plans) > 1) and len(plans[0]) <= SEARCH_ROWS:
            plans += aligned_plans(ctx, pool, items, vpp, True)
            plans.append(align_to_vpp(ctx, packed_rows(ctx, pool, vpp), items, vpp))
        best = plans[0]
        if len(plans) > 1:
            bound = fluid_lower_bound(seqlens, self.domain, self.cost_model)
            best = min(plans, key=lambda rows: plan_rank(ctx, rows, bound))
        return [freeze_microbatch(row) for row in best]


def plan_rank(ctx: Context, rows: Sequence[Row], bound: float) -> Tuple[int, float, float]:
    """Sort key of candidate plans: those within ``GOOD_PLAN`` × the lower bound first, fewest
    micro-batches first; then the shortest critical path."""
    path = draft_critical_path(ctx, rows)
    if path <= GOOD_PLAN * bound:
        return (0, len(rows), path)
    return (1, path, len(rows))


def draft_critical_path(ctx: Context, rows: Sequence[Row]) -> float:
    """Σ over micro-batches of the most-loaded group's per-rank cost and the fixed cost."""
    peaks = sum(max(group.load for group in row) for row in rows)
    return peaks + ctx.cost.microbatch * len(rows)


def heaviest_first(ctx: Context, items: Sequence[Item]) -> List[Item]:
    """Step 1: samples by decreasing least total work, then length, then id (deterministic)."""
    work = ctx.works(items)
    return sorted(items, key=lambda it: (-work[it.seqlen], -it.seqlen, it.sample_id))


def aligned_plans(
    ctx: Context, pool: List[Item], items: Sequence[Item], vpp: Optional[int], all_heavy: bool
) -> List[List[Row]]:
    """Candidate plans of step 2 whose micro-batch count is a multiple of ``vpp``: the plan made
    aligned by :func:`align_to_vpp`, and (when it needed aligning, without ``all_heavy``) the
    plan whose buckets are as many more as the alignment needs, aligned in turn."""
    rows = plan_rows(ctx, pool, all_heavy, vpp=vpp)
    missing = (vpp - len(rows) % vpp) % vpp if vpp else 0
    plans = [align_to_vpp(ctx, rows, items, vpp)]
    if missing and not all_heavy:
        more = plan_rows(ctx, pool, all_heavy, extra_buckets=missing, vpp=vpp)
        plans.append(align_to_vpp(ctx, more, items, vpp))
    return plans


def plan_rows(
    ctx: Context,
    pool: List[Item],
    all_heavy: bool = False,
    extra_buckets: int = 0,
    vpp: Optional[int] = None,
) -> List[Row]:
    """Step 2: micro-batches (rows of groups) until every sample of ``pool`` (heaviest first) is
    placed. While a sample is heavy (or always, with ``all_heavy``), the heaviest opens a
    micro-batch of its own level that takes fillers from the whole pool; the rest is split into
    buckets of equal work (``extra_buckets`` more than the tokens need), one micro-batch each,
    leftovers carried to the next. Last, the lightest micro-batches are dissolved into the
    others where that pays (``row_dissolving``; counts VPP would split again are undone)."""
    rows: List[Row] = []
    while pool and (all_heavy or is_heavy(ctx, pool)):
        row, pool = next_hdp_group(ctx, pool)
        rows.append(row)
    carry: List[Item] = []
    for bucket in equalize_buckets(ctx, pool, extra_buckets):
        row, carry = next_hdp_group(ctx, heaviest_first(ctx, carry + bucket))
        rows.append(row)
    while carry:
        row, carry = next_hdp_group(ctx, carry)
        rows.append(row)
    dissolve_light_rows(ctx, rows, vpp)
    return rows


def packed_rows(ctx: Context, pool: List[Item], vpp: Optional[int] = None) -> List[Row]:
    """Step 2, packing variant: each micro-batch opens with the heaviest sample left on its
    smallest CP size an empty micro-batch can hold, fills up to that sample's level, then takes whatever else of the pool its
    tokens hold where the micro-batch's peak grows least (few micro-batches, each filled; the
    strategy of Megatron dev's greedy scheduler, judged by this cost model)."""
    rows: List[Row] = []
    while pool:
        builder = MicroBatchBuilder(ctx)
        size = next(c for c in ctx.sizes_from(pool[0].min_cp) if ctx.openable(c))
        builder.open(pool[0], size, 0.0)
        rest = builder.fill_from(pool[1:])
        if rest:
            builder.level = float("inf")
            rest = builder.fill_from(rest)
        fill_empty_ranks(ctx, builder.groups, builder.free, rest)
        rebalance_row(ctx, builder.groups)
        rows.append(builder.groups)
        pool = rest
    dissolve_light_rows(ctx, rows, vpp)
    return rows


def is_heavy(ctx: Context, pool: Sequence[Item]) -> bool:
    """True when a sample of ``pool`` can match the pool's fill level only on a CP group so large
    that its total cost grows by more than ``HEAVY_WASTE``: it needs a micro-batch of its own
    (higher) level instead."""
    floor = fill_level(ctx, pool)
    alone, limit = ctx.alone, HEAVY * floor
    return any(
        alone(item.seqlen, item.min_cp) > limit and promotion_waste(ctx, item, floor) > HEAVY_WASTE
        for item in pool
    )


def promotion_waste(ctx: Context, item: Item, level: float) -> float:
    """Relative extra total cost of running ``item`` on the smallest CP group where its per-rank
    cost is within ``level`` (the largest group when none is) instead of its minimum."""
    least = ctx.min_work(item)
    if ctx.alone(item.seqlen, item.min_cp) <= level or least <= 0:
        return 0.0
    for size in ctx.sizes_from(item.min_cp):
        if ctx.alone(item.seqlen, size) <= level:
            break
    return ctx.alone(item.seqlen, size) * size / least - 1.0


def equalize_buckets(ctx: Context, pool: Sequence[Item], extra: int = 0) -> List[List[Item]]:
    """Step 2b, bucket equalization: LPT of ``pool`` into the fewest buckets of N × budget tokens
    its tokens need (more when LPT cannot fit them), plus ``extra``, equal least work each;
    empties dropped."""
    capacity = ctx.domain.size * ctx.domain.budget
    count = max(1, -(-sum(item.seqlen for item in pool) // capacity)) + extra
    buckets = lpt_partition(pool, count, capacity, ctx.min_work)
    while buckets is None:
        count += 1
        buckets = lpt_partition(pool, count, capacity, ctx.min_work)
    return [bucket for bucket in buckets if bucket]


def next_hdp_group(ctx: Context, pool: Sequence[Item]) -> Tuple[Row, List[Item]]:
    """Step 3: form one micro-batch from ``pool`` (heaviest first; non-empty). Returns its groups,
    which partition the domain with no idle rank, and the samples left for later micro-batches."""
    floor = fill_level(ctx, pool)
    last = sum(item.seqlen for item in pool) <= ctx.domain.size * ctx.domain.budget
    best: Optional[Tuple[float, Row, List[Item]]] = None
    for size in trial_sizes(ctx, pool[0], floor):
        groups, leftovers = build_trial(ctx, pool, size, floor, last)
        score = efficiency(ctx, groups)
        if best is None or better_trial((score, len(leftovers)), (best[0], len(best[2]))):
            best = (score, groups, leftovers)
        if score >= GOOD_EFFICIENCY:
            break
    assert best is not None
    rebalance_row(ctx, best[1])
    return best[1], best[2]


def better_trial(new: Tuple[float, int], old: Tuple[float, int]) -> bool:
    """(efficiency, leftover count) of two trials: higher efficiency wins; within ``SCORE_TIE``,
    fewer leftovers (fewer micro-batches)."""
    if abs(new[0] - old[0]) <= SCORE_TIE:
        return new[1] < old[1]
    return new[0] > old[0]


def build_trial(
    ctx: Context, pool: Sequence[Item], size: int, floor: float, last: bool
) -> Tuple[Row, List[Item]]:
    """One trial of :func:`next_hdp_group`: ``pool[0]`` opens on ``size`` ranks, the rest fills up
    to the level (the ``last`` micro-batch may absorb what is left), and idle ranks are filled."""
    builder = MicroBatchBuilder(ctx)
    builder.open(pool[0], size, floor)
    leftovers = builder.fill_from(pool[1:])
    if last and leftovers:
        leftovers = absorb_leftovers(ctx, builder, leftovers)
    fill_empty_ranks(ctx, builder.groups, builder.free, leftovers)
    return builder.groups, leftovers


def absorb_leftovers(ctx: Context, builder: MicroBatchBuilder, leftovers: List[Item]) -> List[Item]:
    """The last micro-batch places its leftovers above the level when that costs less than the
    extra micro-batch they would need (their work / N), give or take ``LAST_SLACK`` of the peak:
    one micro-batch fewer is worth that much. Returns the samples still left."""
    peak = max(group.load for group in builder.groups)
    limit = peak * (1 + LAST_SLACK) + sum(map(ctx.min_work, leftovers)) / ctx.domain.size
    builder.level, builder.journal = float("inf"), []
    rest = builder.fill_from(leftovers)
    if max(group.load for group in builder.groups) > limit:
        builder.undo()
        return leftovers
    return rest


def fill_level(ctx: Context, pool: Sequence[Item]) -> float:
    """The mean per-rank cost of a micro-batch if ``pool`` filled the fewest micro-batches its
    tokens need: the level every micro-batch fills up to (a heavier opening sample raises it)."""
    tokens = sum(item.seqlen for item in pool)
    count = max(1, -(-tokens // (ctx.domain.size * ctx.domain.budget)))
    work = ctx.works(pool)
    return sum(work[item.seqlen] for item in pool) / (ctx.domain.size * count)


def trial_sizes(ctx: Context, item: Item, floor: float) -> List[int]:
    """CP sizes to try for the sample that opens a micro-batch, best guess first: the smallest
    size an empty micro-batch can hold whose per-rank cost is within ``floor`` (or the cheapest
    per rank), then smaller ones, which raise the level (at most ``TRIALS``)."""
    sizes: List[int] = []
    for size in ctx.sizes_from(item.min_cp):
        if not ctx.openable(size):
            continue
        if sizes and ctx.alone(item.seqlen, size) >= ctx.alone(item.seqlen, sizes[-1]):
            break
        sizes.append(size)
        if ctx.alone(item.seqlen, size) <= floor:
            break
    return sizes[::-1][:TRIALS]


def efficiency(ctx: Context, row: Row) -> float:
    """Useful work of a micro-batch (each sample at its minimum CP size) over N × its max rank
    cost: 1 for a perfectly balanced micro-batch without extra CP overhead."""
    peak = max(group.load for group in row)
    if peak <= 0:
        return 1.0
    work = ctx.work  # filled: every sample was ordered by heaviest_first or min_work first
    useful = sum(work.get(item.seqlen) or ctx.min_work(item) for g in row for item in g.items)
    return useful / (ctx.domain.size * peak)


def align_to_vpp(
    ctx: Context, rows: List[Row], items: Sequence[Item], vpp: Optional[int]
) -> List[Row]:
    """Step 6: make the micro-batch count a multiple of ``vpp`` by splitting micro-batches. When
    the count already exceeds the largest such multiple ≤ the sample count, start again from
    whole-domain micro-batches (first-fit decreasing), or raise when even those are too many."""
    if not vpp or len(rows) % vpp == 0:
        return rows
    limit = len(items) - len(items) % vpp
    if len(rows) > limit:
        rows = whole_domain_rows(ctx, items, vpp, limit)
    while len(rows) % vpp:
        split_row(ctx, rows)
    return rows


def whole_domain_rows(ctx: Context, items: Sequence[Item], vpp: int, limit: int) -> List[Row]:
    """Whole-domain micro-batches packed first-fit decreasing by length; ValueError (naming the
    VPP flag) when more than ``limit`` are needed."""
    capacity = ctx.domain.size * ctx.domain.budget
    bins: List[List[Item]] = []
    room: List[int] = []
    for item in sorted(items, key=lambda it: (-it.seqlen, it.sample_id)):
        index = next((i for i, left in enumerate(room) if item.seqlen <= left), len(bins))
        if index == len(bins):
            bins.append([])
            room.append(capacity)
        bins[index].append(item)
        room[index] -= item.seqlen
    if len(bins) > limit:
        raise SchedulingError(
            "{vpp}={k}: the micro-batch count must be a multiple of {k} and at most the sample "
            "count ({count}), but these samples need at least {needed} micro-batches of "
            "{capacity} tokens; use {batch}, a smaller {vpp} or a larger {budget}.",
            k=vpp,
            count=len(items),
            needed=len(bins),
            capacity=capacity,
        )
    return [[whole_domain_group(ctx, bin_items)] for bin_items in bins]


def whole_domain_group(ctx: Context, items: Sequence[Item]) -> GroupDraft:
    """One group over the whole domain holding ``items``."""
    group = ctx.group(ctx.domain.root())
    for item in items:
        group.push(item, ctx.load(item.seqlen, ctx.domain.size))
    return group


def split_row(ctx: Context, rows: List[Row]) -> None:
    """Replace one micro-batch (≥ 2 samples) by two, its samples split into halves of equal
    work, each laid out as one micro-batch: of the micro-batch with the most samples and the
    lightest one, the split that adds the least to the critical path."""
    splittable = [i for i, row in enumerate(rows) if sum(len(g.items) for g in row) >= 2]
    assert splittable, "a VPP split needs a micro-batch with two samples"
    fullest = max(splittable, key=lambda i: (sum(len(g.items) for g in rows[i]), -i))
    lightest = min(splittable, key=lambda i: (max(g.load for g in rows[i]), i))
    options = [
        (index, split_halves(ctx, rows[index])) for index in dict.fromkeys((fullest, lightest))
    ]
    index, halves = min(options, key=lambda o: (split_growth(rows[o[0]], o[1]), o[0]))
    rows[index : index + 1] = halves


def split_halves(ctx: Context, row: Row) -> List[Row]:
    """The samples of ``row`` in two halves of equal work, each laid out as one micro-batch."""
    items = [item for group in row for item in group.items]
    capacity = ctx.domain.size * ctx.domain.budget
    halves = lpt_partition(items, 2, capacity, ctx.min_work)
    assert halves is not None and all(halves)
    return [single_row(ctx, heaviest_first(ctx, half)) for half in halves]


def split_growth(row: Row, halves: Sequence[Row]) -> float:
    """How much replacing ``row`` by ``halves`` adds to Σ peaks."""
    return sum(max(g.load for g in half) for half in halves) - max(g.load for g in row)


def single_row(ctx: Context, items: List[Item]) -> Row:
    """``items`` as one micro-batch: laid out by :func:`next_hdp_group` when everything fits,
    else one whole-domain group (their tokens fit the domain)."""
    row, leftovers = next_hdp_group(ctx, items)
    return row if not leftovers else [whole_domain_group(ctx, items)]
