"""``default_dynamic_cp``: the DCP scheduler.

The objective is the critical path Σ_micro-batch (max_rank cost + the fixed micro-batch cost).
Micro-batches may differ in load; what costs time is imbalance *inside* a micro-batch, CP
overhead (each group's ring steps, carried from its first sample, included) and micro-batches
beyond the fewest. Steps (each a named function; steps 1 and 3 live in ``microbatch_forming``,
4 and 5 in ``row_refinement``, 6 in ``vpp_alignment``, 7 in ``row_exchange``, 8 in
``row_polish``, 9 in ``row_reforming``):

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
                           (in place or afresh, ``split_row``; or fall back to whole-domain
                           micro-batches when there are too many); ``aligned_plans`` also
                           re-plans with as many more buckets as needed.
7. ``exchange_between_rows`` – moves and swaps of samples between micro-batches while that
                           shortens the critical path (``row_exchange``; batches of at most
                           ``SEARCH_SAMPLES`` samples, every candidate plan of at most
                           ``EXCHANGE_ROWS`` micro-batches).
8. ``polish_rows``       – on the chosen plan (same batches): shifts of samples off each
                           micro-batch's top group, redeals of its samples with a light group's,
                           merges of two groups into one of twice the size and splits of a group
                           into halves while that lowers the top (``row_polish``), then step 9,
                           then step 7 again, breaking ties.
9. ``reform_pairs``      – on the chosen plan, unless it is already within ``GOOD_PLAN`` of the
                           lower bound: the samples of two micro-batches pooled and formed again
                           by step 3 (heaviest first, then the rest) and polished, kept when the
                           pair's Σ peaks falls (``row_reforming``; a bounded number of pairs).

Batches of at most ``SEARCH_SAMPLES`` samples, and plans VPP alignment would split (either with
at most ``SEARCH_ROWS`` micro-batches), also try step 2 with every micro-batch formed from the
whole pool and the packing variant (``packed_rows``), and keep the best plan (``plan_rank``, by
``draft_critical_path``). Cost: each micro-batch scans its pool once per trial
(``MicroBatchBuilder`` stops a pass after ``FAIL_LIMIT`` consecutive misses per ``FAIL_SPAN``
ranks once no rank is free, and counts samples it knows would miss without trying them), with one
heap of groups per CP size: O(K · T · n log N) for K micro-batches, T ≤ ``TRIALS`` trials and n
samples. Every step takes the shared
``dynamic_cp_context.Context`` (domain, cost model, memoised costs).

Last, the static-CP plan of the same lengths (``dp_balanced`` at the configured CP size, where it
can run them) competes under the same cost model and is returned when its critical path is
shorter: turning DCP on never plans a longer step than static CP would.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.balance import lpt_partition
from megatron_dcp.scheduling.dp_balanced import DPBalancedScheduler
from megatron_dcp.scheduling.draft import SEQLEN, Item, freeze_microbatch, group_of_items
from megatron_dcp.scheduling.dynamic_cp_context import Context, Row, peak
from megatron_dcp.scheduling.lower_bound import batch_lower_bound
from megatron_dcp.scheduling.microbatch_builder import MicroBatchBuilder
from megatron_dcp.scheduling.microbatch_forming import fill_level, heaviest_first, next_hdp_group
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.metrics import critical_path
from megatron_dcp.scheduling.plan import MicroBatch, Plan
from megatron_dcp.scheduling.registry import Scheduler
from megatron_dcp.scheduling.row_dissolving import dissolve_light_rows
from megatron_dcp.scheduling.row_exchange import exchange_between_rows
from megatron_dcp.scheduling.row_polish import polish_rows
from megatron_dcp.scheduling.row_reforming import reform_pairs
from megatron_dcp.scheduling.row_refinement import fill_empty_ranks, rebalance_row
from megatron_dcp.scheduling.vpp_alignment import align_to_vpp

# A sample is heavy (opens a micro-batch of its own level) when it costs more per rank than
# HEAVY × the mean level and reaching that level would cost it HEAVY_WASTE more CP overhead.
HEAVY = 1.25
HEAVY_WASTE = 0.02
# Batches of at most this many samples (and plans of at most this many micro-batches) also try
# the all-levels and packing variants of ``plan_rows``.
SEARCH_SAMPLES = 512
SEARCH_ROWS = 32
# A plan within this factor of the lower bound is good enough: then fewer micro-batches win, and
# step 9 is not tried.
GOOD_PLAN = 1.02


class DefaultDynamicCPScheduler(Scheduler, name="default_dynamic_cp"):
    """Per-sequence CP sizes, balanced THD micro-batches; see the module docstring."""

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        ctx = Context(self.domain, self.cost_model)
        degree = {length: self.domain.cp_degree(length) for length in set(seqlens)}
        items = list(map(Item, range(len(seqlens)), seqlens, map(degree.__getitem__, seqlens)))
        vpp = self.microbatch_group_size_per_vp_stage
        best = searched_plan(ctx, items, vpp)
        nodes = self.cost_model.nodes
        if len(items) <= SEARCH_SAMPLES and nodes and nodes.node_size < self.domain.size:
            # Over nodes, the plan made blind to them competes too, priced as it is: knowing the
            # nodes never plans a longer critical path than not knowing them.
            blind = Context(self.domain, self.cost_model.with_nodes(None))
            other = repriced(ctx, searched_plan(blind, items, vpp))
            best = min((best, other), key=lambda rows: draft_critical_path(ctx, rows))
        planned = [freeze_microbatch(row) for row in best]
        static = self.static_plan(seqlens)
        if static is not None and critical_path(static, self.cost_model) < self.path(
            seqlens, planned
        ):
            return list(static.microbatches)
        return planned

    def static_plan(self, seqlens: tuple) -> Optional[Plan]:
        """The static-CP plan (``dp_balanced``) of these lengths, or None where static CP cannot
        run them: DCP competes with it under the same cost model and never plans longer.
        Batches with empty samples keep DCP's plan (static bins may hold only empty samples,
        idle ranks that DCP's plans never have)."""
        domain = self.domain
        if 0 in seqlens:
            return None
        try:
            return DPBalancedScheduler(
                domain.dp_size,
                domain.cp_size,
                domain.budget,
                domain.min_cp_size,
                self.microbatch_group_size_per_vp_stage,
                self.cost_model,
            ).schedule(seqlens)
        except SchedulingError:
            return None

    def path(self, seqlens: tuple, microbatches: Sequence[MicroBatch]) -> float:
        """The critical path of DCP's own ``microbatches`` under this scheduler's cost model."""
        vpp = self.microbatch_group_size_per_vp_stage
        plan = Plan(seqlens, self.domain, tuple(microbatches), vpp)
        return critical_path(plan, self.cost_model)


def searched_plan(ctx: Context, items: Sequence[Item], vpp: Optional[int]) -> List[Row]:
    """Steps 2–9: the candidate plans (each refined by step 7 in batches of at most
    ``SEARCH_SAMPLES`` samples), the best by :func:`plan_rank`, then steps 8, 9 and 7 on it."""
    plans = candidate_plans(ctx, items, vpp)
    search = len(items) <= SEARCH_SAMPLES
    if search:
        for rows in plans:
            exchange_between_rows(ctx, rows)
    bound = batch_lower_bound([item.seqlen for item in items], ctx.domain, ctx.cost, vpp)
    best = min(plans, key=lambda rows: plan_rank(ctx, rows, bound))
    if search:
        polish_rows(ctx, best)
        if draft_critical_path(ctx, best) > GOOD_PLAN * bound:
            reform_pairs(ctx, best)
        exchange_between_rows(ctx, best, ties=True)
    return best


def candidate_plans(ctx: Context, items: Sequence[Item], vpp: Optional[int]) -> List[List[Row]]:
    """Step 2's plans, aligned to ``vpp``. Small batches, and plans that VPP alignment would
    split, also try the all-levels and the packing variants (their own micro-batch counts)
    unless the plan is long (each variant costs a scan of the pool per micro-batch)."""
    pool = heaviest_first(ctx, items)
    plans = aligned_plans(ctx, pool, items, vpp, False)
    if (len(items) <= SEARCH_SAMPLES or len(plans) > 1) and len(plans[0]) <= SEARCH_ROWS:
        plans += aligned_plans(ctx, pool, items, vpp, True)
        plans.append(align_to_vpp(ctx, packed_rows(ctx, pool, vpp), items, vpp))
    return plans


def repriced(ctx: Context, rows: Sequence[Row]) -> List[Row]:
    """The same micro-batches with their loads under ``ctx``'s cost model."""
    return [[group_of_items(g.block, g.items, ctx.cost) for g in row] for row in rows]


def plan_rank(ctx: Context, rows: Sequence[Row], bound: float) -> Tuple[int, float, float]:
    """Sort key of candidate plans: those within ``GOOD_PLAN`` × the lower bound first, fewest
    micro-batches first; then the shortest critical path."""
    path = draft_critical_path(ctx, rows)
    if path <= GOOD_PLAN * bound:
        return (0, len(rows), path)
    return (1, path, len(rows))


def draft_critical_path(ctx: Context, rows: Sequence[Row]) -> float:
    """Σ over micro-batches of the most-loaded group's per-rank cost and the fixed cost."""
    return sum(map(peak, rows)) + ctx.cost.microbatch * len(rows)


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
    while pool:
        floor = fill_level(ctx, pool)
        if not (all_heavy or is_heavy(ctx, pool, floor)):
            break
        row, pool = next_hdp_group(ctx, pool, floor)
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
    smallest CP size an empty micro-batch can hold, fills up to that sample's level, then takes
    whatever else of the pool its tokens hold where the micro-batch's peak grows least (few
    micro-batches, each filled; the strategy of Megatron dev's greedy scheduler, judged by this
    cost model)."""
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


def is_heavy(ctx: Context, pool: Sequence[Item], floor: float) -> bool:
    """True when a sample of ``pool`` (heaviest first) can match the pool's fill level only on a
    CP group so large that its total cost grows by more than ``HEAVY_WASTE``: it needs a
    micro-batch of its own (higher) level instead; ``floor`` is the pool's :func:`fill_level`."""
    alone, limit = ctx.alone, HEAVY * floor
    candidates = pool[: count_costlier(ctx, pool, limit)]
    one_per_length = dict(zip(map(SEQLEN, candidates), candidates)).values()  # the length decides
    return any(
        alone(item.seqlen, item.min_cp) > limit and promotion_waste(ctx, item, floor) > HEAVY_WASTE
        for item in one_per_length
    )


def count_costlier(ctx: Context, pool: Sequence[Item], limit: float) -> int:
    """How many samples at the head of ``pool`` (heaviest first) may cost more than ``limit``
    alone on their minimum CP size: a binary search for the first whose cost alone on every
    size up to its minimum is within ``limit``, a bound that never grows along the pool (a
    shorter sample costs less on every size and has no larger minimum)."""
    sizes, low, high = ctx.domain.group_sizes, 0, len(pool)
    while low < high:
        middle = (low + high) // 2
        seqlen, min_cp = pool[middle].seqlen, pool[middle].min_cp
        if max(ctx.alone(seqlen, size) for size in sizes if size <= min_cp) <= limit:
            high = middle
        else:
            low = middle + 1
    return low


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
    """Step 2b, bucket equalization: LPT of ``pool`` (heaviest first, as :func:`heaviest_first`
    orders it) into the fewest buckets of N × budget tokens its tokens need (more when LPT
    cannot fit them), plus ``extra``, equal least work each; empties dropped."""
    capacity = ctx.domain.size * ctx.domain.budget
    count = max(1, -(-sum(item.seqlen for item in pool) // capacity)) + extra
    buckets = lpt_partition(pool, count, capacity, ctx.min_work, ordered=True)
    while buckets is None:
        count += 1
        buckets = lpt_partition(pool, count, capacity, ctx.min_work, ordered=True)
    return [bucket for bucket in buckets if bucket]
