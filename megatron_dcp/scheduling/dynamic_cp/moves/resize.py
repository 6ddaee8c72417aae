"""Inside a micro-batch of a power-of-two domain, group sizes change:

- **merge** the top group with another group of its size into one group of twice the size, when
  the merged load (ring steps and K/V exchange of the larger group included), after a few
  shifts of its samples to light groups, ends below the top's: two heavy groups level each
  other;
- **split** the top group into two groups of half its size, its samples dealt between them,
  when both halves end below it: fewer ring steps and less exchanged K/V.

The rank count does not change: any multiset of power-of-two sizes summing to N lays out on
aligned blocks, largest first (``rank_repair.layout``, which the driver runs after a resize),
and a group's cost depends on its size only.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

from megatron_dcp.scheduling.domain import Block
from megatron_dcp.scheduling.draft import GroupDraft
from megatron_dcp.scheduling.dynamic_cp.moves.shift import find_shift
from megatron_dcp.scheduling.dynamic_cp.moves.transfer import (
    Candidate,
    deal,
    lightest,
    replace_groups,
)
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft, peak


def find_merge(ctx: Context, draft: MicroBatchDraft, top: GroupDraft) -> Optional[Candidate]:
    """The first of the ``knobs.merge_trials`` merges of ``top`` with a group of its size (least
    merged load first) whose micro-batch, after the merged group sheds samples, has every load
    below ``top``'s; None when none does."""
    size = top.size * 2
    if size > ctx.domain.size:
        return None
    base = sum(ctx.load(item.key, size) for item in top.items) + ctx.rings[size]
    options = []
    for group in lightest(draft, top, len(draft)):
        if group.size == top.size:
            load = base + sum(ctx.load(item.key, size) for item in group.items)
            options.append((load, group.block.start, group))
    options.sort(key=lambda option: option[:2])
    for _, _, group in options[: ctx.knobs.merge_trials]:
        trial = merged_microbatch(ctx, draft, top, group)
        if trial is not None:
            return Candidate(peak(trial), partial(draft.__setitem__, slice(None), trial), True)
    return None


def merged_microbatch(
    ctx: Context, draft: MicroBatchDraft, top: GroupDraft, group: GroupDraft
) -> Optional[MicroBatchDraft]:
    """``draft`` with ``top`` and ``group`` merged and the merged group relieved by at most
    ``knobs.shed_steps`` shifts to the lightest groups (copies: ``draft`` is left as it is);
    None unless every load ends below ``top``'s."""
    knobs = ctx.knobs
    size, limit = top.size * 2, top.load * (1 - knobs.eps)
    merged = ctx.group(Block(min(top.block.start, group.block.start), size))
    for item in top.items + group.items:
        merged.push(item, ctx.load(item.key, size))
    rest = lightest(draft, top, len(draft))
    rest.remove(group)
    if rest and rest[-1].load >= limit:
        return None  # another group ties with ``top``
    light = [copy_group(g) for g in rest[: knobs.polish_partners]]
    trial = light + [merged]
    for _ in range(knobs.shed_steps):
        if merged.load < limit:
            break
        shed = find_shift(ctx, trial, merged)
        if shed is None:
            break
        shed.apply()
    if peak(trial) < limit:
        return trial + rest[knobs.polish_partners :]
    return None


def copy_group(group: GroupDraft) -> GroupDraft:
    return GroupDraft(group.block, group.ring, list(group.items), group.load, group.tokens)


def find_split(ctx: Context, draft: MicroBatchDraft, top: GroupDraft) -> Optional[Candidate]:
    """``top``'s samples dealt (:func:`~.transfer.deal`) to two groups of half its size, when
    both hold a non-empty sample and end below ``top``'s load; None otherwise."""
    size = top.size // 2
    if len(top.items) < 2 or size not in ctx.rings:
        return None
    if any(item.min_cp > size for item in top.items):
        return None
    halves = [
        ctx.group(Block(top.block.start, size)),
        ctx.group(Block(top.block.start + size, size)),
    ]
    if not deal(ctx, top.items, halves) or any(h.tokens <= 0 for h in halves):
        return None
    if peak(halves) >= top.load * (1 - ctx.knobs.eps):
        return None
    return Candidate(peak(halves), partial(replace_groups, draft, (top,), halves), True)
