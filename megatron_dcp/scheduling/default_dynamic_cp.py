"""``default_dynamic_cp``: the DCP scheduler.

The objective is the critical path Σ_micro-batch max_rank cost. Micro-batches may differ in load;
what costs time is imbalance *inside* a micro-batch and CP overhead. Steps (each a named function):

1. ``heaviest_first``    – order the samples by least total work (cost at their minimum CP size).
2. ``plan_rows``         – while ``is_heavy`` (a sample could match the mean level only on a CP
                           group whose overhead exceeds ``HEAVY_WASTE``), ``next_hdp_group`` forms
                           a micro-batch from the whole pool; the rest goes through
                           ``equalize_buckets`` (LPT into the fewest buckets of N × budget tokens,
                           equal work) and one ``next_hdp_group`` per bucket, leftovers carried on.
3. ``next_hdp_group``    – one micro-batch: the heaviest sample opens it on a CP group of one of a
                           few sizes (``trial_sizes``), which sets the *level* (its per-rank cost,
                           at least ``fill_level``). Every other sample, heaviest first and then
                           lightest first to top up, takes a fresh block of the smallest CP size
                           whose cost fits under the level, or joins the least-loaded group where
                           it fits (any size ≥ its minimum: a short sequence may get a larger
                           group). The trial with the best ``efficiency`` wins.
4. ``fill_empty_ranks``  – no rank idle: a free block takes a sample from a group holding several,
                           or merges with its neighbours into the parent block.
5. ``rebalance_row``     – bounded refinement: move samples out of the most-loaded group into
                           lighter ones while that lowers the micro-batch's maximum.
6. ``align_to_vpp``      – split micro-batches until the count is a multiple of the VPP group size
                           (or fall back to whole-domain micro-batches when there are too many).

Batches of at most ``SEARCH_SAMPLES`` samples also try step 2 with every micro-batch formed from
the whole pool, and keep the better plan (``plan_rank``). Cost: each micro-batch scans its pool
once per trial (a pass stops after ``FAIL_LIMIT`` consecutive misses once no rank is free), with
one heap of groups per CP size: O(K · T · n log N) for K micro-batches, T ≤ ``TRIALS`` trials
and n samples.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.balance import lpt_partition
from megatron_dcp.scheduling.buddy import BuddyAllocator, contains, parent_block
from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Block, Domain
from megatron_dcp.scheduling.draft import GroupDraft, Item, freeze_microbatch
from megatron_dcp.scheduling.plan import MicroBatch
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.registry import Scheduler

# A sample is heavy (opens a micro-batch of its own level) when it costs more per rank than
# HEAVY × the mean level and reaching that level would cost it HEAVY_WASTE more CP overhead.
HEAVY = 1.25
HEAVY_WASTE = 0.02
# CP sizes tried for the sample that opens a micro-batch, and the efficiency that ends the trials.
TRIALS = 3
GOOD_EFFICIENCY = 0.965
# Trials whose efficiencies differ by at most this much tie (then fewer leftovers win).
SCORE_TIE = 1e-4
# A filling pass stops after this many consecutive samples that fit nowhere (once no rank is free).
FAIL_LIMIT = 48
# Groups skipped per CP size when the least-loaded ones lack token room for a sample.
SKIP_LIMIT = 8
# The last micro-batch may exceed its level by this fraction to save one more micro-batch.
LAST_SLACK = 0.02
# rebalance_row: moves per micro-batch, samples of the top group and partners examined.
REBALANCE_STEPS = 8
REBALANCE_ITEMS = 12
REBALANCE_PARTNERS = 4
# Batches of at most this many samples also try the all-levels variant of ``plan_rows``.
SEARCH_SAMPLES = 256
# A plan within this factor of the lower bound is good enough: then fewer micro-batches win.
GOOD_PLAN = 1.02
EPS = 1e-9

Row = List[GroupDraft]
HeapEntry = Tuple[float, int, GroupDraft]


class CostTable(dict):
    """Per-rank costs keyed by (length, CP size), computed on first use (the hot path)."""

    def __init__(self, cost: CostModel) -> None:
        super().__init__()
        self.cost = cost

    def __missing__(self, key: Tuple[int, int]) -> float:
        value = self[key] = self.cost.per_rank(*key)
        return value


class Context:
    """What every step needs: the domain, the cost model, and memoised costs: ``per_rank[(L,
    c)]`` and ``work[L]`` (least total work of a length-L sample, filled by :meth:`min_work`)."""

    def __init__(self, domain: Domain, cost: CostModel) -> None:
        self.domain, self.cost = domain, cost
        self.per_rank = CostTable(cost)
        self.work: Dict[int, float] = {}
        self._sizes: Dict[int, Tuple[int, ...]] = {}
        self._openable: Dict[int, bool] = {}

    def load(self, seqlen: int, size: int) -> float:
        """Per-rank cost of a sequence of ``seqlen`` tokens on ``size`` ranks."""
        return self.per_rank[seqlen, size]

    def min_work(self, item: Item) -> float:
        """Least total cost of ``item``: at its minimum CP size (which its length determines)."""
        value = self.work.get(item.seqlen)
        if value is None:
            value = self.work[item.seqlen] = self.per_rank[item.seqlen, item.min_cp] * item.min_cp
        return value

    def works(self, items: Sequence[Item]) -> Dict[int, float]:
        """``work``, filled for ``items`` (so hot loops may index it by length)."""
        for item in items:
            if item.seqlen not in self.work:
                self.min_work(item)
        return self.work

    def sizes_from(self, min_cp: int) -> Tuple[int, ...]:
        """The CP group sizes ≥ ``min_cp``, ascending."""
        sizes = self._sizes.get(min_cp)
        if sizes is None:
            sizes = self._sizes[min_cp] = tuple(s for s in self.domain.group_sizes if s >= min_cp)
        return sizes

    def openable(self, size: int) -> bool:
        """True when an empty micro-batch can hold a group of ``size`` ranks."""
        if size not in self._openable:
            self._openable[size] = BuddyAllocator(self.domain).can_allocate(size)
        return self._openable[size]

    def room(self, group: GroupDraft) -> int:
        """Tokens ``group`` can still take within the budget."""
        return group.size * self.domain.budget - group.tokens


class DefaultDynamicCPScheduler(Scheduler, name="default_dynamic_cp"):
    """Per-sequence CP sizes, balanced THD micro-batches; see the module docstring."""

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        ctx = Context(self.domain, self.cost_model)
        items = [Item(i, seqlen, self.domain.cp_degree(seqlen)) for i, seqlen in enumerate(seqlens)]
        pool = heaviest_first(ctx, items)
        vpp = self.microbatch_group_size_per_vp_stage
        # Small batches also try the all-levels variant (cheap there) and keep the better plan.
        variants = (False, True) if len(items) <= SEARCH_SAMPLES else (False,)
        plans = [align_to_vpp(ctx, plan_rows(ctx, pool, v), items, vpp) for v in variants]
        work = ctx.works(items)
        bound = sum(work[item.seqlen] for item in items) / self.domain.size
        best = min(plans, key=lambda rows: plan_rank(rows, bound))
        return [freeze_microbatch(row) for row in best]


def plan_rank(rows: Sequence[Row], bound: float) -> Tuple[int, float, float]:
    """Sort key of candidate plans: those within ``GOOD_PLAN`` × the lower bound first, fewest
    micro-batches first; then the shortest critical path."""
    path = critical_path(rows)
    if path <= GOOD_PLAN * bound:
        return (0, len(rows), path)
    return (1, path, len(rows))


def critical_path(rows: Sequence[Row]) -> float:
    """Σ over micro-batches of the most-loaded group's per-rank cost."""
    return sum(max(group.load for group in row) for row in rows)


def heaviest_first(ctx: Context, items: Sequence[Item]) -> List[Item]:
    """Step 1: samples by decreasing least total work, then length, then id (deterministic)."""
    work = ctx.works(items)
    return sorted(items, key=lambda it: (-work[it.seqlen], -it.seqlen, it.sample_id))


def plan_rows(ctx: Context, pool: List[Item], all_heavy: bool = False) -> List[Row]:
    """Step 2: micro-batches (rows of groups) until every sample of ``pool`` (heaviest first) is
    placed. While a sample is heavy (or always, with ``all_heavy``), the heaviest opens a
    micro-batch of its own level that takes fillers from the whole pool; the rest is split into
    buckets of equal work, one micro-batch each, leftovers carried to the next."""
    rows: List[Row] = []
    while pool and (all_heavy or is_heavy(ctx, pool)):
        row, pool = next_hdp_group(ctx, pool)
        rows.append(row)
    carry: List[Item] = []
    for bucket in equalize_buckets(ctx, pool):
        row, carry = next_hdp_group(ctx, heaviest_first(ctx, carry + bucket))
        rows.append(row)
    while carry:
        row, carry = next_hdp_group(ctx, carry)
        rows.append(row)
    return rows


def is_heavy(ctx: Context, pool: Sequence[Item]) -> bool:
    """True when a sample of ``pool`` can match the pool's fill level only on a CP group so large
    that its total cost grows by more than ``HEAVY_WASTE``: it needs a micro-batch of its own
    (higher) level instead."""
    floor = fill_level(ctx, pool)
    per_rank, limit = ctx.per_rank, HEAVY * floor
    return any(
        per_rank[item.seqlen, item.min_cp] > limit
        and promotion_waste(ctx, item, floor) > HEAVY_WASTE
        for item in pool
    )


def promotion_waste(ctx: Context, item: Item, level: float) -> float:
    """Relative extra total cost of running ``item`` on the smallest CP group where its per-rank
    cost is within ``level`` (the largest group when none is) instead of its minimum."""
    least = ctx.min_work(item)
    if ctx.load(item.seqlen, item.min_cp) <= level or least <= 0:
        return 0.0
    for size in ctx.sizes_from(item.min_cp):
        if ctx.load(item.seqlen, size) <= level:
            break
    return ctx.load(item.seqlen, size) * size / least - 1.0


def equalize_buckets(ctx: Context, pool: Sequence[Item]) -> List[List[Item]]:
    """Step 2b, bucket equalization: LPT of ``pool`` into the fewest buckets of N × budget tokens
    its tokens need (more when LPT cannot fit them), equal least work each; empties dropped."""
    capacity = ctx.domain.size * ctx.domain.budget
    count = max(1, -(-sum(item.seqlen for item in pool) // capacity))
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
        groups, leftovers = lay_out(ctx, pool, size, floor, last)
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


def lay_out(
    ctx: Context, pool: Sequence[Item], size: int, floor: float, last: bool
) -> Tuple[Row, List[Item]]:
    """One trial of :func:`next_hdp_group`: ``pool[0]`` opens on ``size`` ranks, the rest fills up
    to the level (the ``last`` micro-batch may absorb what is left), and idle ranks are filled."""
    layout = Layout(ctx)
    layout.open(pool[0], size, floor)
    leftovers = layout.fill_from(pool[1:])
    if last and leftovers:
        leftovers = absorb_leftovers(ctx, layout, leftovers)
    fill_empty_ranks(ctx, layout.groups, layout.free, leftovers)
    return layout.groups, leftovers


def absorb_leftovers(ctx: Context, layout: "Layout", leftovers: List[Item]) -> List[Item]:
    """The last micro-batch places its leftovers above the level when that costs less than the
    extra micro-batch they would need (their work / N), give or take ``LAST_SLACK`` of the peak:
    one micro-batch fewer is worth that much. Returns the samples still left."""
    peak = max(group.load for group in layout.groups)
    limit = peak * (1 + LAST_SLACK) + sum(map(ctx.min_work, leftovers)) / ctx.domain.size
    layout.level, layout.journal = float("inf"), []
    rest = layout.fill_from(leftovers)
    if max(group.load for group in layout.groups) > limit:
        layout.undo()
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
        if sizes and ctx.load(item.seqlen, size) >= ctx.load(item.seqlen, sizes[-1]):
            break
        sizes.append(size)
        if ctx.load(item.seqlen, size) <= floor:
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


class Layout:
    """One micro-batch under construction: its groups (a heap of them per CP size, least-loaded
    on top), its free blocks, and its level (the per-rank cost no sample may push a group past)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.free = BuddyAllocator(ctx.domain)
        self.groups: Row = []
        self.heaps: Dict[int, List[HeapEntry]] = {}
        self.sizes: List[int] = []  # the keys of ``heaps``, ascending
        self.level = 0.0
        self.shortest = 0  # the shortest sample still to place: groups with less room are full
        # Placements (group, sample, load, fresh) recorded for :meth:`undo` when not None.
        self.journal: Optional[List[Tuple[GroupDraft, Item, float, bool]]] = None

    def open(self, item: Item, size: int, floor: float) -> None:
        """Place the first sample on a fresh group of ``size`` ranks; the level is its cost or
        ``floor``, whichever is higher."""
        self._add_group(item, size)
        self.level = max(self.groups[0].load, floor) * (1 + EPS)

    def fill_from(self, pool: Sequence[Item]) -> List[Item]:
        """Place what fits of ``pool`` (heaviest first), then top up lightest first; returns the
        samples not placed, in pool order."""
        taken = [False] * len(pool)
        self.shortest = min((item.seqlen for item in pool), default=0)
        resume = self._pass(pool, range(len(pool)), taken)
        self._pass(pool, range(len(pool) - 1, resume - 1, -1), taken)
        return [item for item, was_taken in zip(pool, taken) if not was_taken]

    def _pass(self, pool: Sequence[Item], order: range, taken: List[bool]) -> int:
        """Try the samples of ``pool`` in ``order``; returns the first index not tried (a pass
        ends after ``FAIL_LIMIT`` consecutive misses once no rank is free)."""
        misses = 0
        for index in order:
            if taken[index]:
                continue
            if self.place(pool[index]):
                taken[index], misses = True, 0
            elif not self.free.free:
                misses += 1
                if misses >= FAIL_LIMIT:
                    return index + 1
        return order.stop if order.step > 0 else len(pool)

    def place(self, item: Item) -> bool:
        """Put ``item`` on a fresh block of the smallest size whose cost fits under the level,
        else on the least-loaded group where it fits; False when it fits nowhere."""
        return self._place_fresh(item) or self._join(item)

    def undo(self) -> None:
        """Take back the placements recorded in the journal (the heaps are not kept: call only
        when no more samples will be placed)."""
        for group, item, load, fresh in reversed(self.journal or []):
            group.pop(item, load)
            if fresh:
                self.groups.remove(group)
                self.free.free.append(group.block)
        self.journal = None

    def _place_fresh(self, item: Item) -> bool:
        if not self.free.free:
            return False
        per_rank = self.ctx.per_rank
        for size in self.ctx.sizes_from(item.min_cp):
            if per_rank[item.seqlen, size] <= self.level and self.free.can_allocate(size):
                self._add_group(item, size)
                return True
        return False

    def _join(self, item: Item) -> bool:
        """Add ``item`` to the group where its resulting load is least and within the level."""
        best_total, best_size = self.level, 0
        skipped: List[Tuple[int, HeapEntry]] = []
        seqlen, budget, per_rank = item.seqlen, self.ctx.domain.budget, self.ctx.per_rank
        for size in self.sizes:
            heap = self.heaps[size]
            if size < item.min_cp or not heap:
                continue
            if heap[0][2].tokens > size * budget - seqlen:
                self._skip_full(heap, size, seqlen, skipped)
                if not heap or heap[0][2].tokens > size * budget - seqlen:
                    continue
            total = heap[0][0] + per_rank[seqlen, size]
            if total < best_total or (total == best_total and not best_size):
                best_total, best_size = total, size
        if best_size:
            heap = self.heaps[best_size]
            group = heapq.heappop(heap)[2]
            group.push(item, per_rank[seqlen, best_size])
            heapq.heappush(heap, (group.load, group.block.start, group))
            if self.journal is not None:
                self.journal.append((group, item, per_rank[seqlen, best_size], False))
        for size, entry in skipped:  # groups too full for any sample of the pool leave the heap
            if size * budget - entry[2].tokens >= self.shortest:
                heapq.heappush(self.heaps[size], entry)
        return bool(best_size)

    def _skip_full(
        self, heap: List[HeapEntry], size: int, seqlen: int, skipped: List[Tuple[int, HeapEntry]]
    ) -> None:
        """Pop (into ``skipped``) up to ``SKIP_LIMIT`` least-loaded groups without token room."""
        limit = size * self.ctx.domain.budget - seqlen
        for _ in range(SKIP_LIMIT):
            if not heap or heap[0][2].tokens <= limit:
                return
            skipped.append((size, heapq.heappop(heap)))

    def _add_group(self, item: Item, size: int) -> None:
        block = self.free.allocate(size)
        assert block is not None, f"no free block of {size} ranks"
        group = GroupDraft(block)
        group.push(item, self.ctx.load(item.seqlen, size))
        self.groups.append(group)
        if self.journal is not None:
            self.journal.append((group, item, group.load, True))
        if size not in self.heaps:
            self.heaps[size] = []
            self.sizes = sorted(self.heaps)
        heapq.heappush(self.heaps[size], (group.load, block.start, group))


def fill_empty_ranks(
    ctx: Context, groups: Row, free: BuddyAllocator, spare: Optional[List[Item]] = None
) -> None:
    """Step 4: no rank may be idle. Each free block (smallest first) takes the sample whose move
    from a group holding several leaves the lowest load, else the lightest fitting sample of
    ``spare`` (removed from it), else it and its neighbouring groups merge into one group over
    the parent block."""
    while free.free:
        block = min(free.free, key=lambda b: (b.size, b.start))
        free.free.remove(block)
        item = take_donor(ctx, groups, block) or take_spare(ctx, spare or [], block)
        if item is not None:
            group = GroupDraft(block)
            group.push(item, ctx.load(item.seqlen, block.size))
            groups.append(group)
        else:
            merge_into_parent(ctx, groups, free, block)


def take_spare(ctx: Context, spare: List[Item], block: Block) -> Optional[Item]:
    """Remove and return the last (lightest, for a heaviest-first list) sample of ``spare`` that
    fits ``block``; None when none does."""
    for index in range(len(spare) - 1, -1, -1):
        item = spare[index]
        if item.min_cp <= block.size and item.seqlen <= block.size * ctx.domain.budget:
            return spare.pop(index)
    return None


def take_donor(ctx: Context, groups: Row, block: Block) -> Optional[Item]:
    """Remove and return the sample whose move into ``block`` leaves the smallest maximum of the
    two loads, among groups holding several samples; None when no group can spare one."""
    best: Optional[Tuple[Tuple[float, int, int], GroupDraft, Item]] = None
    for group in groups:
        if len(group.items) < 2:
            continue
        for item in group.items:
            if item.min_cp > block.size or item.seqlen > block.size * ctx.domain.budget:
                continue
            remaining = group.load - ctx.load(item.seqlen, group.size)
            peak = max(remaining, ctx.load(item.seqlen, block.size))
            key = (peak, group.block.start, item.sample_id)
            if best is None or key < best[0]:
                best = (key, group, item)
    if best is None:
        return None
    _, group, item = best
    group.pop(item, ctx.load(item.seqlen, group.size))
    return item


def merge_into_parent(ctx: Context, groups: Row, free: BuddyAllocator, block: Block) -> None:
    """Replace ``block``'s parent subtree (groups and free blocks) by one group over the parent,
    or by one free block when the subtree holds no group (buddies freed separately)."""
    parent = parent_block(ctx.domain, block)
    inside = sorted((g for g in groups if contains(parent, g.block)), key=lambda g: g.block.start)
    free.free = [b for b in free.free if not contains(parent, b)]
    if not inside:
        free.free.append(parent)
        return
    merged = GroupDraft(parent)
    for group in inside:
        groups.remove(group)
        for item in group.items:
            merged.push(item, ctx.load(item.seqlen, parent.size))
    groups.append(merged)


def rebalance_row(ctx: Context, row: Row) -> None:
    """Step 5: move a sample from the most-loaded group to one of the lightest groups while that
    lowers the larger of the two loads (at most ``REBALANCE_STEPS`` moves)."""
    for _ in range(REBALANCE_STEPS):
        ordered = sorted(row, key=lambda g: (g.load, g.block.start))
        top, partners = ordered[-1], ordered[:REBALANCE_PARTNERS]
        move = best_move(ctx, top, [g for g in partners if g is not top])
        if move is None:
            return
        item, partner = move
        top.pop(item, ctx.load(item.seqlen, top.size))
        partner.push(item, ctx.load(item.seqlen, partner.size))


def best_move(
    ctx: Context, top: GroupDraft, partners: Sequence[GroupDraft]
) -> Optional[Tuple[Item, GroupDraft]]:
    """The (sample of ``top``, partner) move that lowers max(top, partner) the most; None if none
    does. ``top`` keeps at least one sample; at most ``REBALANCE_ITEMS`` samples are examined."""
    if len(top.items) < 2:
        return None
    best, best_peak = None, top.load * (1 - EPS)
    for item in spread(top.items, REBALANCE_ITEMS):
        for partner in partners:
            if item.min_cp > partner.size or ctx.room(partner) < item.seqlen:
                continue
            peak = max(
                top.load - ctx.load(item.seqlen, top.size),
                partner.load + ctx.load(item.seqlen, partner.size),
            )
            if peak < best_peak:
                best, best_peak = (item, partner), peak
    return best


def spread(items: Sequence[Item], count: int) -> List[Item]:
    """At most ``count`` of ``items``, evenly spaced in their current order."""
    if len(items) <= count:
        return list(items)
    step = len(items) / count
    return [items[int(k * step)] for k in range(count)]


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
    group = GroupDraft(ctx.domain.root())
    for item in items:
        group.push(item, ctx.load(item.seqlen, ctx.domain.size))
    return group


def split_row(ctx: Context, rows: List[Row]) -> None:
    """Replace the micro-batch with the most samples (≥ 2) by two, its samples split into halves
    of equal work, each laid out as one micro-batch."""
    index = max(range(len(rows)), key=lambda i: (sum(len(g.items) for g in rows[i]), -i))
    items = [item for group in rows[index] for item in group.items]
    assert len(items) >= 2, "a VPP split needs a micro-batch with two samples"
    capacity = ctx.domain.size * ctx.domain.budget
    halves = lpt_partition(items, 2, capacity, ctx.min_work)
    assert halves is not None and all(halves)
    rows[index : index + 1] = [single_row(ctx, heaviest_first(ctx, half)) for half in halves]


def single_row(ctx: Context, items: List[Item]) -> Row:
    """``items`` as one micro-batch: laid out by :func:`next_hdp_group` when everything fits,
    else one whole-domain group (their tokens fit the domain)."""
    row, leftovers = next_hdp_group(ctx, items)
    return row if not leftovers else [whole_domain_group(ctx, items)]
