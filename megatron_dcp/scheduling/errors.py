"""Errors of the scheduling layer, worded in its own parameters.

The planner knows nothing of command lines: an input it cannot plan raises
:class:`SchedulingError`, whose message names the scheduling parameters (``budget``,
``min_cp_size``, ...). A layer with flags (the training entry point, the RL adapter, the
``megatron-dcp`` tools) re-words the same error for its user with :meth:`SchedulingError.worded`,
which puts the flag the user typed in each parameter's place.

A message is a template: ``{budget}``-style fields stand for parameter names (filled from a
wording), every other field is a value given to the constructor.
"""

from __future__ import annotations

from typing import Any, Mapping

# How the scheduling layer itself names each parameter (the keyword arguments of build_scheduler
# and Domain). ``batch`` is the prose for "the sequences of one global batch".
PARAMETERS: Mapping[str, str] = {
    "budget": "budget",
    "min_cp_size": "min_cp_size",
    "dp_size": "dp_size",
    "cp_size": "cp_size",
    "vpp": "microbatch_group_size_per_vp_stage",
    "scheduler": "scheduler",
    "cost_model": "cost_model",
    "hardware": "hardware",
    "batch": "more sequences in the batch",
    "max_seqlen": "shorter sequences",
    "max_samples": "max_samples_per_group",
    "patches": "patches",
}


class SchedulingError(ValueError):
    """Bad input to a scheduler: a setting it cannot run with, or a batch it cannot plan."""

    def __init__(self, template: str, **values: Any) -> None:
        self.template = template
        self.values = values
        super().__init__(self.worded(PARAMETERS))

    def worded(self, names: Mapping[str, str]) -> str:
        """The message with each parameter named as in ``names`` (missing ones keep the
        scheduling name)."""
        return self.template.format(**{**PARAMETERS, **names}, **self.values)

    def __reduce__(self) -> tuple:
        """Picklable across processes (the fuzzer's workers) with its template and values."""
        return (_rebuild, (self.template, self.values))


def _rebuild(template: str, values: Mapping[str, Any]) -> SchedulingError:
    return SchedulingError(template, **values)
