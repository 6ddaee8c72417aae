"""Step 8 of ``default_dynamic_cp``: ``polish_row``, a local search on one micro-batch.

A micro-batch costs its most-loaded group. The earlier steps place each sample once and move
only a few; this pass works on the finished micro-batch, always on its top group, with four
moves, each accepted only when the loads it touches all end below the top's load (so the sorted
load vector falls and the search ends):

- a **shift**: a sample of the top group moves to, or trades places with a shorter sample of,
  one of the lightest groups;
- a **redeal**: the samples of the top group and of one of the lightest groups are dealt again
  between their two blocks, heaviest first to where the load ends least (several samples change
  places at once, which no shift does);
- a **merge** (power-of-two domains): the top group and another group of its size become one
  group of twice the size, when the merged load (ring steps and K/V exchange of the larger
  group included), after a few shifts of its samples to light groups, is below the top's: two
  heavy groups level each other;
- a **split** (power-of-two domains): the top group's samples are dealt to two groups of half
  its size, when both halves end below it: fewer ring steps and less exchanged K/V.

Group sizes change, not the rank count: in a power-of-two domain any multiset of power-of-two
sizes summing to N lays out on aligned blocks, largest first (``row_refinement.layout``), and a
group's cost depends on its size only. Bounded by ``POLISH_STEPS`` moves per micro-batch.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.domain import Block, is_power_of_two
from megatron_dcp.scheduling.draft import GroupDraft, Item
from megatron_dcp.scheduling.dynamic_cp_context import EPS, Context, Row
from megatron_dcp.scheduling.row_refinement import layout, spread

# Moves per micro-batch; samples of the top group examined; lightest groups examined as
# partners (shifts and merges); samples of a partner examined for a trade.
POLISH_STEPS = 32
POLISH_ITEMS = 8
POLISH_PARTNERS = 8
TRADE_ITEMS = 4
# Merge partners tried, and shifts relieving a merged group.
MERGE_TRIALS = 3
SHED_STEPS = 8


def polish_row(ctx: Context, row: Row) -> bool:
    """Shift, redeal, merge and split around the top group of ``row`` while one lowers it (see the
    module docstring); returns True when the row changed (laid out again when sizes did)."""
    halving = is_power_of_two(ctx.domain.size)
    changed = resized = False
    for _ in range(POLISH_STEPS):
        top = max(row, key=lambda g: (g.load, -g.block.start))
        if shift(ctx, row, top) or redeal(ctx, row, top):
            changed = True
        elif halving and (merge(ctx, row, top) or split(ctx, row, top)):
            changed = resized = True
        else:
            break
    if resized:
        layout(ctx, row, {id(group): group.size for group in row})
    return changed


def lightest(row: Row, top: GroupDraft, count: int) -> List[GroupDraft]:
    """The ``count`` least-loaded groups of ``row`` other than ``top``."""
    others = [group for group in row if group is not top]
    others.sort(key=lambda g: (g.load, g.block.start))
    return others[:count]


def shift(ctx: Context, row: Row, top: GroupDraft) -> bool:
    """Move a sample of ``top`` to a light group, or trade it for a shorter sample there, when
    both loads end below ``top``'s; the best such shift (lowest larger load) is made. Samples are
    examined heaviest first: once ``top`` would stay above the best found without one, it would
    without every lighter one too."""
    best: Optional[Tuple[float, Item, GroupDraft, Optional[Item]]] = None
    limit = top.load * (1 - EPS)
    partners = lightest(row, top, POLISH_PARTNERS)
    costs = ctx.per_size[top.size]
    ordered = sorted(top.items, key=lambda it: (-it.seqlen, it.sample_id))
    for item in spread(ordered, POLISH_ITEMS):
        out = costs[item.seqlen]
        if top.load - out >= limit:
            break
        for group in partners:
            if group.load >= limit:
                break  # heavier partners end above the limit too
            if group.size < item.min_cp:
                continue
            for peak, back in shift_options(ctx, top, item, out, group, limit):
                if peak < limit:
                    best, limit = (peak, item, group, back), peak
    if best is None:
        return False
    _, item, group, back = best
    top.pop(item, ctx.load(item.seqlen, top.size))
    if back is not None:
        group.pop(back, ctx.load(back.seqlen, group.size))
        top.push(back, ctx.load(back.seqlen, top.size))
    group.push(item, ctx.load(item.seqlen, group.size))
    return True


def shift_options(
    ctx: Context, top: GroupDraft, item: Item, out: float, group: GroupDraft, limit: float
) -> List[Tuple[float, Optional[Item]]]:
    """(larger resulting load, sample traded back or None) of moving ``item`` (per-rank cost
    ``out`` on ``top``) to ``group`` below ``limit``: a move when ``top`` keeps a non-empty
    sample, trades with shorter samples of ``group`` that ``top`` can take."""
    options: List[Tuple[float, Optional[Item]]] = []
    group_costs, top_costs = ctx.per_size[group.size], ctx.per_size[top.size]
    budget, left = ctx.domain.budget, top.tokens - item.seqlen
    grown = group.load + group_costs[item.seqlen]
    room = group.size * budget - group.tokens - item.seqlen
    if left > 0 and room >= 0:
        options.append((max(top.load - out, grown), None))
    top_room = top.size * budget - left
    shed = top.load - out
    for back in spread(group.items, TRADE_ITEMS):
        length = back.seqlen
        if length >= item.seqlen or room + length < 0 or back.min_cp > top.size:
            continue
        if length > top_room or left + length <= 0:
            continue
        peak = max(shed + top_costs[length], grown - group_costs[length])
        options.append((peak, back))
    return options


def merge(ctx: Context, row: Row, top: GroupDraft) -> bool:
    """Merge ``top`` with another group of its size into one group of twice the ranks, when the
    merged group, after at most ``SHED_STEPS`` shifts of its samples to light groups, ends below
    ``top``'s load with every other load; partners are tried by the merged load, least first."""
    size = top.size * 2
    if size > ctx.domain.size:
        return False
    base = sum(ctx.load(item.seqlen, size) for item in top.items) + ctx.rings[size]
    options = []
    for group in lightest(row, top, len(row)):
        if group.size == top.size:
            load = base + sum(ctx.load(item.seqlen, size) for item in group.items)
            options.append((load, group.block.start, group))
    options.sort(key=lambda option: option[:2])
    for _, _, group in options[:MERGE_TRIALS]:
        trial = merged_row(ctx, row, top, group)
        if trial is not None:
            row[:] = trial
            return True
    return False


def merged_row(ctx: Context, row: Row, top: GroupDraft, group: GroupDraft) -> Optional[Row]:
    """``row`` with ``top`` and ``group`` merged and the merged group relieved by shifts to the
    lightest groups (copies: ``row`` is left as it is); None unless every load ends below
    ``top``'s."""
    size, limit = top.size * 2, top.load * (1 - EPS)
    merged = ctx.group(Block(min(top.block.start, group.block.start), size))
    for item in top.items + group.items:
        merged.push(item, ctx.load(item.seqlen, size))
    rest = lightest(row, top, len(row))
    rest.remove(group)
    if rest and rest[-1].load >= limit:
        return None  # another group ties with ``top``
    light = [copy_group(g) for g in rest[:POLISH_PARTNERS]]
    trial = light + [merged]
    for _ in range(SHED_STEPS):
        if merged.load < limit or not shift(ctx, trial, merged):
            break
    if max(g.load for g in trial) < limit:
        return trial + rest[POLISH_PARTNERS:]
    return None


def copy_group(group: GroupDraft) -> GroupDraft:
    return GroupDraft(group.block, group.ring, list(group.items), group.load, group.tokens)


def split(ctx: Context, row: Row, top: GroupDraft) -> bool:
    """Deal ``top``'s samples (heaviest first, to the lighter half with token room) to two groups
    of half its size, when both end below ``top``'s load."""
    size = top.size // 2
    if len(top.items) < 2 or size not in ctx.rings:
        return False
    if any(item.min_cp > size for item in top.items):
        return False
    halves = [
        ctx.group(Block(top.block.start, size)),
        ctx.group(Block(top.block.start + size, size)),
    ]
    for item in sorted(top.items, key=lambda it: (-it.seqlen, it.sample_id)):
        fits = [h for h in halves if ctx.room(h) >= item.seqlen]
        if not fits:
            return False
        target = min(fits, key=lambda h: h.load)
        target.push(item, ctx.load(item.seqlen, size))
    if any(h.tokens <= 0 for h in halves) or max(h.load for h in halves) >= top.load * (1 - EPS):
        return False
    row.remove(top)
    row.extend(halves)
    return True


def redeal(ctx: Context, row: Row, top: GroupDraft) -> bool:
    """Deal the samples of ``top`` and of a light group again between their two blocks,
    heaviest first to the group it leaves least loaded, when both end below ``top``'s load; the
    best such pair is kept (several samples change places at once, which no shift does)."""
    best: Optional[Tuple[float, GroupDraft, Row]] = None
    limit = top.load * (1 - EPS)
    for group in lightest(row, top, POLISH_PARTNERS):
        if len(top.items) + len(group.items) < 3:
            continue
        pair = dealt(ctx, top, group)
        if pair is not None and max(g.load for g in pair) < limit:
            best, limit = (max(g.load for g in pair), group, pair), max(g.load for g in pair)
    if best is None:
        return False
    _, group, pair = best
    row.remove(top)
    row.remove(group)
    row.extend(pair)
    return True


def dealt(ctx: Context, top: GroupDraft, group: GroupDraft) -> Optional[Row]:
    """New groups over the blocks of ``top`` and ``group`` holding their samples, each sample
    (heaviest first) where the resulting load is least; None when a sample fits neither or a
    group would be left without a non-empty sample."""
    pair = [ctx.group(top.block), ctx.group(group.block)]
    pool = sorted(top.items + group.items, key=lambda it: (-it.seqlen, it.sample_id))
    for item in pool:
        fits = [g for g in pair if g.size >= item.min_cp and ctx.room(g) >= item.seqlen]
        if not fits:
            return None
        target = min(fits, key=lambda g: (g.load + ctx.load(item.seqlen, g.size), g.block.start))
        target.push(item, ctx.load(item.seqlen, target.size))
    if any(g.tokens <= 0 for g in pair):
        return None
    return pair


def polish_rows(ctx: Context, rows: Sequence[Row]) -> None:
    """:func:`polish_row` on every micro-batch of a plan."""
    for row in rows:
        polish_row(ctx, row)
