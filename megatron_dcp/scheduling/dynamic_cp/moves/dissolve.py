"""Across the plan, at the end of construction: **dissolve** the lightest micro-batches into the
groups of the others (``dissolve_light_microbatches``).

The last micro-batches of a plan hold what the balanced ones left over. With few samples and no
rank allowed to idle, their groups are large for their work, and under a cost with ring steps
and a per-micro-batch fixed cost they are the most expensive work of the plan per token. A
micro-batch is dissolved when every sample fits (by tokens and minimum CP size) into a group of
another micro-batch and the peaks of those micro-batches grow by less than the dissolved
micro-batch's peak plus its fixed cost: the critical path gets shorter.
"""

from __future__ import annotations

from bisect import insort
from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.draft import GroupDraft, Item, longest_first
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft, peak

Move = Tuple[GroupDraft, Item, float]


def dissolve_light_microbatches(
    ctx: Context, drafts: List[MicroBatchDraft], vpp: Optional[int] = None
) -> None:
    """Dissolve the lightest micro-batch while that shortens the critical path. With ``vpp``,
    keep the dissolutions up to the last micro-batch count that is a multiple of it (none when
    no count on the way is): a count VPP must split again gains nothing."""
    history: List[Tuple[int, MicroBatchDraft, List[Move]]] = []
    while len(drafts) > 1:
        index = min(range(len(drafts)), key=lambda i: (peak(drafts[i]), i))
        if len(samples_of(drafts[index])) > ctx.knobs.dissolve_samples:
            break
        draft, moves = drafts[index], dissolve(ctx, drafts, index)
        if moves is None:
            break
        history.append((index, draft, moves))
    while vpp and len(drafts) % vpp and history:
        index, draft, moves = history.pop()
        undo(moves)
        drafts.insert(index, draft)


def samples_of(draft: MicroBatchDraft) -> List[Item]:
    return [item for group in draft for item in group.items]


def dissolve(ctx: Context, drafts: List[MicroBatchDraft], index: int) -> Optional[List[Move]]:
    """Move every sample of ``drafts[index]`` (heaviest first) to the group of another draft where
    its draft's peak grows least; keep the moves and drop the draft when the peaks grew by less than
    the draft's peak and fixed cost (returns the moves), else undo them (returns None)."""
    saving = peak(drafts[index]) + ctx.cost.microbatch
    others = [Targets(draft) for i, draft in enumerate(drafts) if i != index]
    victims = longest_first(samples_of(drafts[index]))
    moves: List[Move] = []
    growth = 0.0
    for item in victims:
        choice = best_target(ctx, others, item)
        if choice is None or growth + choice[0] >= saving:
            undo(moves)
            return None
        delta, targets, key = choice
        moves.append(targets.add(key, item, ctx.load(item.key, targets.draft[key[2]].size)))
        growth += delta
    del drafts[index]
    return moves


Key = Tuple[float, int, int]


class Targets:
    """The groups of one draft as keys (load, block start, index) ordered least-loaded first, and
    the draft's peak."""

    def __init__(self, draft: MicroBatchDraft) -> None:
        self.draft = draft
        self.order: List[Key] = sorted((g.load, g.block.start, i) for i, g in enumerate(draft))
        self.peak = peak(draft)

    def add(self, key: Key, item: Item, load: float) -> Move:
        """Put ``item`` (per-rank cost ``load``) on the group of ``key``."""
        group = self.draft[key[2]]
        self.order.remove(key)
        group.push(item, load)
        insort(self.order, (group.load, key[1], key[2]))
        self.peak = max(self.peak, group.load)
        return group, item, load


def best_target(
    ctx: Context, others: Sequence[Targets], item: Item
) -> Optional[Tuple[float, Targets, Key]]:
    """(peak growth, draft, group key) of the least-loaded fitting group (among the first
    ``knobs.dissolve_scan``) of the draft whose peak grows least (ties: the lowest resulting load);
    None when the sample fits nowhere."""
    best: Optional[Tuple[Tuple[float, float], Targets, Key]] = None
    budget = ctx.domain.budget
    for targets in others:
        for key in targets.order[: ctx.knobs.dissolve_scan]:
            group = targets.draft[key[2]]
            if group.fits(item, budget):
                after = group.load + ctx.load(item.key, group.size)
                rank = (max(0.0, after - targets.peak), after)
                if best is None or rank < best[0]:
                    best = (rank, targets, key)
                break
    return None if best is None else (best[0][0], best[1], best[2])


def undo(moves: Sequence[Move]) -> None:
    """Take the moved samples back out of their new groups (the caller restores their draft)."""
    for group, item, load in reversed(moves):
        group.pop(item, load)
