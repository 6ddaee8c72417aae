"""The search state of ``default_dynamic_cp``: what construction, alignment and every move
share (:class:`Context`: the domain, the cost model, the :class:`~.knobs.Knobs` and memoised
per-rank costs) and the *micro-batch draft* (:data:`MicroBatchDraft`, the mutable groups of one
micro-batch), with its peak, a plan's critical path, the order the moves across the plan visit
micro-batches in and the acceptance rule of those moves."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from megatron_dcp.scheduling.buddy import BuddyAllocator
from megatron_dcp.scheduling.cost import CostKey, CostModel, SizeCosts, key_length
from megatron_dcp.scheduling.domain import Block, Domain
from megatron_dcp.scheduling.draft import GroupDraft, Item
from megatron_dcp.scheduling.dynamic_cp.knobs import DEFAULT_KNOBS, Knobs

# One micro-batch under construction: its groups.
MicroBatchDraft = List[GroupDraft]


def peak(draft: MicroBatchDraft) -> float:
    """A micro-batch's most-loaded group's per-rank cost: what it adds to the critical path."""
    return max(group.load for group in draft)


def min_plan_gain(ctx: "Context", *peaks: float) -> float:
    """The acceptance rule of the moves across the plan: the least fall of Σ peaks a move must
    bring, ``knobs.min_gain`` of the larger peak of the micro-batches it touches."""
    return ctx.knobs.min_gain * max(peaks)


def most_loaded_first(drafts: Sequence[MicroBatchDraft]) -> List[int]:
    """The indices of ``drafts`` by falling peak (ties: the earlier micro-batch): the order the
    moves across the plan visit micro-batches in."""
    peaks = [peak(draft) for draft in drafts]
    return sorted(range(len(drafts)), key=lambda i: (-peaks[i], i))


def searchable(ctx: "Context", drafts: Sequence[MicroBatchDraft]) -> bool:
    """True when sample moves across the plan search ``drafts``: plans of at most
    ``knobs.search_microbatches`` micro-batches (such a search costs O(K²) for K of them)."""
    return len(drafts) <= ctx.knobs.search_microbatches


def draft_critical_path(ctx: "Context", drafts: Sequence[MicroBatchDraft]) -> float:
    """Σ over micro-batches of the most-loaded group's per-rank cost and the fixed cost."""
    return sum(map(peak, drafts)) + ctx.cost.microbatch * len(drafts)


class WorkTable(dict):
    """Least total cost of a sample (at its minimum CP size, which its length determines) keyed
    by its cost key (``cost.cost_keys``: the length L, or (L, patches)), computed on first use."""

    def __init__(self, domain: Domain, per_size: Dict[int, SizeCosts]) -> None:
        super().__init__()
        self.domain, self.per_size = domain, per_size

    def __missing__(self, key: CostKey) -> float:
        size = self.domain.cp_degree(key_length(key))
        value = self[key] = self.per_size[size][key] * size
        return value


class Context:
    """What construction and every move need: the domain, the cost model, the knobs and memoised
    costs: ``per_size[c][k]`` (per-rank cost of a sample of cost key k on c ranks: the length L
    of a text sample, (L, patches) of one with vision work) and ``work[k]`` (its least total
    work). ``vision``: some sample's key holds patches, so cost no longer follows the length
    alone (the orders and shortcuts that assume it check this flag)."""

    def __init__(
        self, domain: Domain, cost: CostModel, knobs: Knobs = DEFAULT_KNOBS, vision: bool = False
    ) -> None:
        self.domain, self.cost, self.knobs, self.vision = domain, cost, knobs, vision
        self.per_size = {size: SizeCosts(cost, size) for size in domain.group_sizes}
        self.rings = {size: cost.ring_cost(size) for size in domain.group_sizes}
        self.work = WorkTable(domain, self.per_size)
        self._sizes: Dict[int, Tuple[int, ...]] = {}
        self._openable: Dict[int, bool] = {}

    def load(self, key: CostKey, size: int) -> float:
        """Per-rank cost a sample of cost key ``key`` (a length, or (length, patches)) adds to
        a group of ``size`` ranks."""
        return self.per_size[size][key]

    def alone(self, key: CostKey, size: int) -> float:
        """Per-rank cost of a group of ``size`` ranks holding only this sample (ring steps
        included)."""
        return self.per_size[size][key] + self.rings[size]

    def group(self, block: Block) -> GroupDraft:
        """An empty group over ``block``."""
        return GroupDraft(block, self.rings[block.size])

    def min_work(self, item: Item) -> float:
        """Least total cost of ``item``: at its minimum CP size (which its length determines)."""
        return self.work[item.key]

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
