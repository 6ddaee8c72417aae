"""``default_dynamic_cp``: the DCP scheduler.

Steps (each a named function below):
1. ``candidate_counts``   – micro-batch counts to try, from the token lower bound upwards, each
                            VPP-aligned (``align_microbatch_count``).
2. ``equalize_buckets``   – one bucket of samples per micro-batch, of roughly equal work.
3. ``next_hdp_group``     – lay one micro-batch out: heaviest sample first, into a fresh aligned
                            block of its CP size (larger when the sample alone would exceed the
                            micro-batch's mean load) or the group where the resulting load is least;
                            then ``fill_empty_ranks`` and ``balance_microbatch``. Samples that do not
                            fit move on to the next bucket.
4. ``balance_across_microbatches`` – move or swap samples between micro-batches while that
                            shortens the critical path Σ_micro-batch max_rank cost.
The count whose plan has the shortest critical path wins (the first within ``GOOD_ENOUGH`` of the
lower bound ends the search).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.balance import align_microbatch_count, lpt_partition
from megatron_dcp.scheduling.buddy import BuddyAllocator, contains, parent_block
from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Block, Domain
from megatron_dcp.scheduling.draft import GroupDraft, Item, freeze_microbatch, group_of_items
from megatron_dcp.scheduling.load_index import LoadIndex
from megatron_dcp.scheduling.plan import MicroBatch
from megatron_dcp.scheduling.registry import VPP_FLAG, Scheduler

# Stop trying more micro-batch counts once the critical path is this close to the lower bound.
GOOD_ENOUGH = 1.01
# Counts tried: the token lower bound, then each this much larger, up to one sample per micro-batch.
COUNT_STEPS = (0, 1, 2)
COUNT_GROWTH = 1.25
# Local search: partners examined per move (the least-loaded groups) and sweep limits.
PARTNERS = 8
CROSS_SWEEPS = 8
# Items of a group examined per move (spread over its sizes); bounds the swap search.
MOVE_ITEMS = 12
EPS = 1e-9

Draft = List[GroupDraft]
Move = Tuple[Item, Optional[Item]]


@dataclass(frozen=True)
class Context:
    """What every step needs: the domain and the cost model."""

    domain: Domain
    cost: CostModel

    def min_work(self, item: Item) -> float:
        """Least total cost of ``item``: at its minimum CP size."""
        return self.cost.per_rank(item.seqlen, item.min_cp) * item.min_cp


class DefaultDynamicCPScheduler(Scheduler, name="default_dynamic_cp"):
    """Per-sequence CP sizes, balanced THD micro-batches; see the module docstring."""

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        ctx = Context(self.domain, self.cost_model)
        items = [Item(i, seqlen, self.domain.cp_degree(seqlen)) for i, seqlen in enumerate(seqlens)]
        bound = sum(ctx.min_work(item) for item in items) / self.domain.size
        best: Optional[Tuple[float, List[Draft]]] = None
        vpp = self.microbatch_group_size_per_vp_stage
        for count in candidate_counts(ctx, items, vpp):
            drafts = pack(ctx, items, count)
            if drafts is None:
                continue
            path = critical_path(drafts)
            if best is None or path < best[0] * (1 - EPS):
                best = (path, drafts)
            if path <= GOOD_ENOUGH * bound:
                break
        assert best is not None, f"no micro-batch count packs {len(items)} samples"
        return [freeze_microbatch(draft) for draft in best[1]]


def candidate_counts(ctx: Context, items: Sequence[Item], vpp: Optional[int]) -> Iterator[int]:
    """Step 1: micro-batch counts to try, ascending and VPP-aligned, from the token lower bound;
    none exceeds ``len(items)`` (one sample per micro-batch, which always packs)."""
    last = len(items) - len(items) % vpp if vpp else len(items)
    if last == 0:
        raise ValueError(
            f"{VPP_FLAG}={vpp}: the global batch has {len(items)} samples, fewer than one "
            f"micro-batch group needs; use a larger --global-batch-size or a smaller group size."
        )
    capacity = ctx.domain.size * ctx.domain.budget
    first = max(1, -(-sum(item.seqlen for item in items) // capacity))
    counts = {first + step for step in COUNT_STEPS} | {int(first * COUNT_GROWTH) + 1}
    aligned = {min(align_microbatch_count(c, vpp), last) for c in counts}
    yield from sorted(aligned)
    if last not in aligned:
        yield last


def pack(ctx: Context, items: Sequence[Item], count: int) -> Optional[List[Draft]]:
    """Steps 2–4 for a fixed micro-batch count; None when the samples do not fit."""
    buckets = equalize_buckets(ctx, items, count)
    if buckets is None:
        return None
    drafts, carry = [], []
    for bucket in buckets:
        draft, carry = next_hdp_group(ctx, carry + bucket)
        if not draft:
            return None
        drafts.append(draft)
    if carry:
        return None
    balance_across_microbatches(ctx, drafts)
    return drafts


def equalize_buckets(ctx: Context, items: Sequence[Item], count: int) -> Optional[List[List[Item]]]:
    """Step 2: one bucket per micro-batch, equal work (LPT), at most N × budget tokens each."""
    capacity = ctx.domain.size * ctx.domain.budget
    buckets = lpt_partition(items, count, capacity, ctx.min_work)
    if buckets is None or not all(buckets):
        return None
    return buckets


def next_hdp_group(ctx: Context, items: Sequence[Item]) -> Tuple[Draft, List[Item]]:
    """Step 3: lay out one micro-batch from ``items``; returns its groups and the leftovers."""
    ordered = sorted(items, key=lambda it: (-ctx.min_work(it), it.sample_id))
    layout = Layout(ctx, target=sum(map(ctx.min_work, ordered)) / ctx.domain.size)
    leftovers = [item for item in ordered if not layout.place(item)]
    if layout.groups:
        fill_empty_ranks(ctx, layout.groups, layout.free)
        balance_microbatch(ctx, LoadIndex(layout.groups))
    return layout.groups, leftovers


def cp_size_for(ctx: Context, item: Item, target: float) -> int:
    """The item's CP size: its minimum, doubled while it alone would exceed ``target`` per rank
    and the larger group is cheaper per rank (a short sequence may get a larger group)."""
    sizes = ctx.domain.group_sizes
    index = sizes.index(item.min_cp)
    per_rank = ctx.cost.per_rank
    while (
        index + 1 < len(sizes)
        and per_rank(item.seqlen, sizes[index]) > target
        and per_rank(item.seqlen, sizes[index + 1]) < per_rank(item.seqlen, sizes[index])
    ):
        index += 1
    return sizes[index]


class Layout:
    """Groups of one micro-batch under construction, a heap of them per CP size, and free blocks."""

    def __init__(self, ctx: Context, target: float) -> None:
        self.ctx, self.target = ctx, target
        self.free = BuddyAllocator(ctx.domain)
        self.groups: Draft = []
        self.heaps: Dict[int, List[Tuple[float, int, GroupDraft]]] = {}

    def place(self, item: Item) -> bool:
        """Put ``item`` where the resulting per-rank load is least: a fresh block of its CP size
        or the least-loaded group with room. False when it fits nowhere."""
        size = cp_size_for(self.ctx, item, self.target)
        fresh = self.ctx.cost.per_rank(item.seqlen, size) if self.free.can_allocate(size) else None
        skipped: List[Tuple[int, Tuple[float, int, GroupDraft]]] = []
        best = self._best_group(item, size, skipped)
        if fresh is not None and (best is None or fresh <= best[0]):
            self._add_group(group_of_items(self.free.allocate(size), [item], self.ctx.cost))
        elif best is not None:
            _, _, group = heapq.heappop(self.heaps[best[1]])
            group.add(item, self.ctx.cost)
            heapq.heappush(self.heaps[best[1]], (group.load, group.block.start, group))
        for group_size, entry in skipped:
            heapq.heappush(self.heaps[group_size], entry)
        return fresh is not None or best is not None

    def _best_group(self, item: Item, size: int, skipped: list) -> Optional[Tuple[float, int]]:
        """(resulting load, group size) of the best existing group; groups without room for
        ``item`` are popped into ``skipped`` so that each heap's top is the candidate."""
        best = None
        for group_size, heap in self.heaps.items():
            if group_size < size:
                continue
            while heap and not heap[0][2].fits(item, self.ctx.domain.budget):
                skipped.append((group_size, heapq.heappop(heap)))
            if heap:
                load = heap[0][2].load_with(item, self.ctx.cost)
                if best is None or (load, group_size) < best:
                    best = (load, group_size)
        return best

    def _add_group(self, group: GroupDraft) -> None:
        self.groups.append(group)
        heap = self.heaps.setdefault(group.size, [])
        heapq.heappush(heap, (group.load, group.block.start, group))


def fill_empty_ranks(ctx: Context, groups: Draft, free: BuddyAllocator) -> None:
    """No rank may be idle: give each free block a sample taken from a group that holds several,
    or, when none can be spared, merge the free block and its sibling groups into one group."""
    while free.free:
        block = min(free.free, key=lambda b: (b.size, b.start))
        free.free.remove(block)
        donor = best_donor(ctx, groups, block)
        if donor is not None:
            group, item = donor
            group.remove(item, ctx.cost)
            groups.append(group_of_items(block, [item], ctx.cost))
        else:
            merge_into_parent(ctx, groups, free, block)


def best_donor(ctx: Context, groups: Draft, block: Block) -> Optional[Tuple[GroupDraft, Item]]:
    """The (group, item) whose move into ``block`` leaves the smallest maximum of the two loads."""
    best, best_key = None, None
    for group in groups:
        if len(group.items) < 2:
            continue
        for item in group.items:
            if item.min_cp > block.size:
                continue
            load = max(group.load_without(item, ctx.cost), ctx.cost.per_rank(item.seqlen, block.size))
            key = (load, group.block.start, item.sample_id)
            if best_key is None or key < best_key:
                best, best_key = (group, item), key
    return best


def merge_into_parent(ctx: Context, groups: Draft, free: BuddyAllocator, block: Block) -> None:
    """Replace ``block``'s parent subtree (groups and free blocks) by one group over the parent."""
    parent = parent_block(ctx.domain, block)
    inside = [g for g in groups if contains(parent, g.block)]
    items = [item for g in sorted(inside, key=lambda g: g.block.start) for item in g.items]
    for g in inside:
        groups.remove(g)
    free.free = [b for b in free.free if not contains(parent, b)]
    groups.append(group_of_items(parent, items, ctx.cost))


def balance_microbatch(ctx: Context, index: LoadIndex) -> None:
    """Move or swap samples out of the most-loaded group while that lowers the micro-batch max."""
    for _ in range(2 * len(index.groups) + 16):
        top = index.top
        partners = [g for g in index.lightest(PARTNERS + 1) if g is not top][:PARTNERS]
        choice = best_move(ctx, top, partners, lambda new_top, new_partner, _: top.load - max(new_top, new_partner))
        if choice is None:
            return
        apply_move(ctx, (index, top), (index, choice[0]), choice[1])


def best_move(ctx: Context, top: GroupDraft, partners: Sequence[GroupDraft], gain_of) -> Optional[Tuple[GroupDraft, Move]]:
    """The partner and move (or swap) with the largest positive ``gain_of(new_top, new_partner,
    partner)``."""
    best, best_gain = None, EPS * max(1.0, top.load)
    for partner in partners:
        for move in candidate_moves(ctx, top, partner):
            new_top, new_partner = loads_after(ctx, top, partner, move)
            gain = gain_of(new_top, new_partner, partner)
            if gain > best_gain:
                best, best_gain = (partner, move), gain
    return best


def candidate_moves(ctx: Context, top: GroupDraft, partner: GroupDraft) -> Iterator[Move]:
    """Moves of one item from ``top`` to ``partner`` and swaps of one item each way that keep both
    groups non-empty, within budget and within the items' minimum CP sizes."""
    budget = ctx.domain.budget
    top_room = top.size * budget - top.tokens
    partner_room = partner.size * budget - partner.tokens
    for x in _spread(top.items):
        if x.min_cp > partner.size:
            continue
        if len(top.items) > 1 and x.seqlen <= partner_room:
            yield x, None
        for y in _spread(partner.items):
            if (
                y.min_cp <= top.size
                and x.seqlen - y.seqlen <= partner_room
                and y.seqlen - x.seqlen <= top_room
            ):
                yield x, y


def _spread(items: List[Item]) -> List[Item]:
    """At most ``MOVE_ITEMS`` of ``items``, evenly spaced in their current order."""
    if len(items) <= MOVE_ITEMS:
        return items
    step = len(items) / MOVE_ITEMS
    return [items[int(k * step)] for k in range(MOVE_ITEMS)]


def loads_after(ctx: Context, top: GroupDraft, partner: GroupDraft, move: Move) -> Tuple[float, float]:
    x, y = move
    per_rank = ctx.cost.per_rank
    new_top = top.load - per_rank(x.seqlen, top.size)
    new_partner = partner.load + per_rank(x.seqlen, partner.size)
    if y is not None:
        new_top += per_rank(y.seqlen, top.size)
        new_partner -= per_rank(y.seqlen, partner.size)
    return new_top, new_partner


def apply_move(ctx: Context, source: Tuple[LoadIndex, GroupDraft], target: Tuple[LoadIndex, GroupDraft], move: Move) -> None:
    """Apply ``move`` from ``source`` to ``target`` (each an index and its group)."""
    (source_index, top), (target_index, partner) = source, target
    source_index.detach(top)
    target_index.detach(partner)
    x, y = move
    top.remove(x, ctx.cost)
    partner.add(x, ctx.cost)
    if y is not None:
        partner.remove(y, ctx.cost)
        top.add(y, ctx.cost)
    source_index.attach(top)
    target_index.attach(partner)


def balance_across_microbatches(ctx: Context, drafts: List[Draft]) -> None:
    """Step 4: lower Σ max load by moving work from a micro-batch's most-loaded group into groups
    of other micro-batches that sit well below their own micro-batch's max."""
    indexes = [LoadIndex(draft) for draft in drafts]
    for _ in range(CROSS_SWEEPS):
        if not _cross_sweep(ctx, indexes):
            return


def _cross_sweep(ctx: Context, indexes: List[LoadIndex]) -> bool:
    """One pass over the micro-batches, most imbalanced first; True if anything moved."""
    owner = {id(g): index for index in indexes for g in index.lightest(PARTNERS)}
    slack = sorted(owner.items(), key=lambda kv: kv[1].max_load - _group(kv[1], kv[0]).load, reverse=True)
    pool = [(_group(index, key), index) for key, index in slack[: 4 * PARTNERS]]
    moved = False
    for index in sorted(indexes, key=lambda ix: ix.mean_load - ix.max_load):
        partners = [(g, ix) for g, ix in pool if ix is not index]
        top, max_a, second_a = index.top, index.max_load, index.second_load
        by_group = {id(g): ix for g, ix in partners}

        def gain(new_top: float, new_partner: float, partner: GroupDraft) -> float:
            max_b = by_group[id(partner)].max_load
            return (max_a - max(new_top, second_a)) - max(0.0, new_partner - max_b)

        choice = best_move(ctx, top, [g for g, _ in partners], gain)
        if choice is not None:
            apply_move(ctx, (index, top), (by_group[id(choice[0])], choice[0]), choice[1])
            moved = True
    return moved


def _group(index: LoadIndex, key: int) -> GroupDraft:
    return next(g for g in index.groups if id(g) == key)


def critical_path(drafts: Sequence[Draft]) -> float:
    return sum(max(g.load for g in draft) for draft in drafts)
