"""Pure-Python DCP scheduling: plan types, cost model, schedulers and the simulator.

Imports neither torch nor megatron (a test enforces it).
"""

from megatron_dcp.scheduling.cost import CostModel, ModelShape, build_cost_model
from megatron_dcp.scheduling.domain import Block, Domain
from megatron_dcp.scheduling.plan import CPGroup, InvalidPlanError, MicroBatch, Plan
from megatron_dcp.scheduling.registry import SCHEDULERS, Scheduler, build_scheduler

# Registered on import.
from megatron_dcp.scheduling import dp_balanced, dynamic_cp  # noqa: E402,F401  isort:skip

__all__ = [
    "SCHEDULERS",
    "Block",
    "CPGroup",
    "CostModel",
    "Domain",
    "InvalidPlanError",
    "MicroBatch",
    "ModelShape",
    "Plan",
    "Scheduler",
    "build_cost_model",
    "build_scheduler",
]
