"""What the moves share: how a sample changes groups (:func:`transfer`, a move or, with a sample
sent back, a swap), how samples are dealt to groups (:func:`deal`), which samples and partner
groups a move examines (:func:`spread`, :func:`lightest`) and the candidates the two drivers
accept or refuse (:class:`Candidate` inside a micro-batch, :class:`PlanCandidate` across the
plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.draft import SAMPLE_ID, GroupDraft, Item, longest_first
from megatron_dcp.scheduling.dynamic_cp.search_state import Context, MicroBatchDraft


@dataclass(frozen=True)
class Candidate:
    """A move found inside one micro-batch: the highest load it leaves on the groups it touches
    (``peak``) and how to make it (``apply``). The driver makes it when ``peak`` is below the
    micro-batch's top."""

    peak: float
    apply: Callable[[], None]
    resizes: bool = False  # group sizes change: the micro-batch is laid out again afterwards


@dataclass(frozen=True)
class PlanCandidate:
    """A move found across the plan: how much it lowers Σ peaks (``gain``; a tie-break: how much
    it lowers the tied top group, no peak growing), the peaks the acceptance rule weighs it
    against (``peaks``) and how to make it (``apply``). The driver makes it when ``gain`` exceeds
    :func:`~.search_state.min_plan_gain` of ``peaks``."""

    gain: float
    peaks: Tuple[float, ...]
    apply: Callable[[], None]


def heaviest_on(ctx: Context, items: List[Item], size: int) -> List[Item]:
    """``items`` sorted in place by decreasing per-rank cost on ``size`` ranks, then id; returns
    them. Without vision work that is longest first (cost grows with the length)."""
    if not ctx.vision:
        return longest_first(items)
    costs = ctx.per_size[size]
    items.sort(key=SAMPLE_ID)
    items.sort(key=lambda item: costs[item.key], reverse=True)
    return items


def lighter(ctx: Context, back: Item, item: Item, size: int) -> bool:
    """True when ``back`` costs less than ``item`` on ``size`` ranks: with vision work a sample
    at least as long may be the lighter one (its key, not its length, prices it)."""
    return ctx.load(back.key, size) < ctx.load(item.key, size)


def transfer(
    ctx: Context, source: GroupDraft, item: Item, target: GroupDraft, back: Optional[Item]
) -> None:
    """Move ``item`` from ``source`` to ``target``; with ``back``, ``target``'s sample ``back``
    goes the other way (a swap)."""
    source.pop(item, ctx.load(item.key, source.size))
    if back is not None:
        target.pop(back, ctx.load(back.key, target.size))
        source.push(back, ctx.load(back.key, source.size))
    target.push(item, ctx.load(item.key, target.size))


def deal(ctx: Context, items: Sequence[Item], groups: Sequence[GroupDraft]) -> bool:
    """Deal ``items`` to ``groups`` longest first, each to the group it leaves least loaded among
    those that can take it (token room, minimum CP size; ties: the earlier group). False when a
    sample fits none (the groups then hold a part of the samples)."""
    for item in longest_first(list(items)):
        best, best_load = None, 0.0
        for group in groups:
            if group.size < item.min_cp or ctx.room(group) < item.seqlen:
                continue
            load = group.load + ctx.load(item.key, group.size)
            if best is None or load < best_load:
                best, best_load = group, load
        if best is None:
            return False
        best.push(item, ctx.load(item.key, best.size))
    return True


def spread(items: Sequence[Item], count: int) -> List[Item]:
    """At most ``count`` of ``items``, evenly spaced in their current order."""
    if len(items) <= count:
        return list(items)
    step = len(items) / count
    return [items[int(k * step)] for k in range(count)]


def lightest(draft: MicroBatchDraft, top: GroupDraft, count: int) -> List[GroupDraft]:
    """The ``count`` least-loaded groups of ``draft`` other than ``top``."""
    others = [group for group in draft if group is not top]
    others.sort(key=lambda g: (g.load, g.block.start))
    return others[:count]


def replace_groups(
    draft: MicroBatchDraft, old: Sequence[GroupDraft], new: Sequence[GroupDraft]
) -> None:
    """Replace the groups ``old`` of ``draft`` by ``new``."""
    for group in old:
        draft.remove(group)
    draft.extend(new)
