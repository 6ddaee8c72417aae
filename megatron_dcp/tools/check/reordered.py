"""The reference arm of ``megatron-dcp check``: static CP with the same plan taken in another
order, which measures what float rounding alone does to the loss and the gradients.

``static_reordered`` runs ``dp_balanced``'s plan of the batch with its micro-batches in reverse
order and every CP group's samples in reverse order inside its pack: the same sequences on the
same CP groups, so the same math, summed in another order (the gradients accumulate over the
micro-batches in reverse, and a pack's tokens meet the weight-gradient GEMMs in another order).
Its distance from ``static`` is the measured rounding that ``tools.check.tolerance`` scales.
"""

from __future__ import annotations

from typing import Dict, List

from megatron_dcp.scheduling.dp_balanced import DPBalancedScheduler
from megatron_dcp.scheduling.plan import CPGroup, MicroBatch
from megatron_dcp.tools.bench_train.arms import ARMS

REORDERED = "static_reordered"
CHECK_ARMS = ("static", REORDERED, "dcp")


class ReorderedStaticScheduler(DPBalancedScheduler):
    """``dp_balanced``'s plan in reverse order (module docstring). Not registered by name: only
    ``check``'s workers plan with it."""

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        return [
            MicroBatch(tuple(CPGroup(g.ranks, g.sample_ids[::-1]) for g in microbatch.groups))
            for microbatch in reversed(super()._schedule(seqlens))
        ]


def check_schedulers() -> Dict[str, type]:
    """The scheduler class of every arm ``check`` runs."""
    return {**ARMS, REORDERED: ReorderedStaticScheduler}
