"""``dp_balanced``: the static-CP baseline. Every group is a fixed CP block of size ``cp_size``."""

from __future__ import annotations

from itertools import repeat
from typing import List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.balance import align_microbatch_count, lpt_partition
from megatron_dcp.scheduling.domain import Block, least_budget
from megatron_dcp.scheduling.cost import SizeCosts, cost_keys
from megatron_dcp.scheduling.draft import SAMPLE_ID, Item, longest_first
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.plan import CPGroup, MicroBatch
from megatron_dcp.scheduling.registry import Scheduler


class DPBalancedScheduler(Scheduler, name="dp_balanced"):
    """Packs sequences into bins of ``budget × cp_size`` tokens balanced by cost, spread over DP."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cp_block = Block(0, self.domain.cp_size)
        if not self.domain.is_group_block(cp_block):
            raise SchedulingError(
                "{cp_size}={cp}: dp_balanced needs a CP group of exactly {cp_size} ranks, which "
                "requires a power of two ≥ {min_cp_size}={min_cp} (or {dp_size} 1).",
                cp=self.domain.cp_size,
                min_cp=self.domain.min_cp_size,
            )

    prices_patches = True

    def _schedule(self, seqlens: tuple, patches: Tuple[int, ...] = ()) -> List[MicroBatch]:
        dp, cp = self.domain.dp_size, self.domain.cp_size
        # Every sample's cost on its CP group, memoised by cost key (its length, or its length
        # and patches; a batch repeats lengths) for this plan: the cost model may be replaced
        # between plans (online refinement).
        self._costs = SizeCosts(self.cost_model, cp)
        keys = cost_keys(seqlens, patches, self.cost_model)
        items = list(map(Item, range(len(seqlens)), seqlens, repeat(cp), keys))
        self._check_fits(items)
        capacity = cp * self.domain.budget
        count = align_microbatch_count(-(-sum(seqlens) // (capacity * dp)), self._vpp)
        while count * dp <= len(items):
            bins = lpt_partition(items, count * dp, capacity, self._weight)
            if bins is not None and all(bins):
                return [self._microbatch(bins[m * dp : (m + 1) * dp]) for m in range(count)]
            count = align_microbatch_count(count + 1, self._vpp)
        vpp = " and {vpp}={k} (the count must be its multiple)" if self._vpp else ""
        smaller_vpp = "a smaller {vpp}, " if self._vpp else ""
        raise SchedulingError(
            "dp_balanced: {count} samples cannot fill {dp} DP ranks in every micro-batch (static "
            f"CP leaves ranks idle){vpp}; use {{batch}}, {smaller_vpp}or default_dynamic_cp.",
            count=len(items),
            dp=dp,
            k=self._vpp,
        )

    @property
    def _vpp(self) -> Optional[int]:
        return self.microbatch_group_size_per_vp_stage

    def _weight(self, item: Item) -> float:
        return self._costs[item.key]

    def _check_fits(self, items: Sequence[Item]) -> None:
        """Every sample fits static CP; otherwise the error names the longest and the budget
        that holds it."""
        limit = self.domain.cp_size * self.domain.budget
        longest = max(items, key=lambda item: item.seqlen)
        if longest.seqlen > limit:
            raise SchedulingError(
                "{budget}={value}: sample {sample_id} has {seqlen} tokens, the longest, more than "
                "static CP{cp} holds ({limit}); raise {budget} to at least {least} or use "
                "{scheduler} default_dynamic_cp.",
                value=self.domain.budget,
                sample_id=longest.sample_id,
                seqlen=longest.seqlen,
                cp=self.domain.cp_size,
                limit=limit,
                least=least_budget(longest.seqlen, self.domain.cp_size),
            )

    def _microbatch(self, bins: Sequence[List[Item]]) -> MicroBatch:
        """The micro-batch of ``bins`` (one per DP rank, in rank order), frozen as
        ``freeze_microbatch`` freezes groups (samples longest first, then by id) without pricing
        them: a frozen plan holds no loads."""
        cp = self.domain.cp_size
        groups = [
            CPGroup(Block(d * cp, cp).positions, tuple(map(SAMPLE_ID, longest_first(items))))
            for d, items in enumerate(bins)
        ]
        return MicroBatch(tuple(groups))
