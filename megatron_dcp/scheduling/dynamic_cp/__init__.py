"""``default_dynamic_cp``, the DCP scheduler, as one construction and one search: see
``scheduler`` for the phases, ``knobs`` for every constant, ``moves/`` for the moves."""

from megatron_dcp.scheduling.dynamic_cp.knobs import Knobs
from megatron_dcp.scheduling.dynamic_cp.scheduler import DefaultDynamicCPScheduler

__all__ = ["DefaultDynamicCPScheduler", "Knobs"]
