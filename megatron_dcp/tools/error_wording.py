"""Scheduling errors worded with the simulator's flags: a :class:`SchedulingError` names its
scheduling parameters (``budget``, ``min_cp_size``, ...); the simulator's commands and reports
name them as the flags that set them."""

from __future__ import annotations

from megatron_dcp.scheduling.errors import SchedulingError

# The simulator's flags for the scheduling parameters its errors name.
FLAGS = {
    "budget": "--max-seqlen-per-dp-cp-rank",
    "min_cp_size": "--min-cp-size",
    "dp_size": "--dp-size",
    "cp_size": "--cp-size",
    "vpp": "--microbatch-group-size-per-vp-stage",
    "scheduler": "--scheduler",
    "cost_model": "--cost-model",
    "hardware": "--hardware",
    "batch": "more sequences (--num-sequences, --tokens-per-global-batch)",
    "max_seqlen": "shorter sequences",
}


def error_message(error: ValueError) -> str:
    """``error`` worded with the simulator's flags."""
    return error.worded(FLAGS) if isinstance(error, SchedulingError) else str(error)
