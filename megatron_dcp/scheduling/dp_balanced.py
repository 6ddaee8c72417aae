"""``dp_balanced``: the static-CP baseline. Every group is a fixed CP block of size ``cp_size``."""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron_dcp.scheduling.balance import align_microbatch_count, lpt_partition
from megatron_dcp.scheduling.domain import Block, least_budget
from megatron_dcp.scheduling.draft import Item, freeze_microbatch, group_of_items
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.plan import MicroBatch
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

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        dp, cp = self.domain.dp_size, self.domain.cp_size
        items = [Item(i, seqlen, cp) for i, seqlen in enumerate(seqlens)]
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
        return self.cost_model.per_rank(item.seqlen, self.domain.cp_size)

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

    def _microbatch(self, bins: Sequence[Sequence[Item]]) -> MicroBatch:
        cp = self.domain.cp_size
        groups = [
            group_of_items(Block(d * cp, cp), items, self.cost_model)
            for d, items in enumerate(bins)
        ]
        return freeze_microbatch(groups)
