"""The switch that checks the coverage checks: ``MEGATRON_DCP_FORCE_STATIC_PLAN=1`` makes the DCP
planner (``default_dynamic_cp``) return the static plan, so that every oracle test claiming a
mix of CP sizes (``testing.plan_coverage``) must fail, naming the missing coverage. For that
check only: nothing but this module and tests/conftest.py reads the variable.

- **What it plans.** ``dp_balanced`` over the same DP×CP domain at the configured CP size; where
  static CP cannot run the batch (a sample longer than the static group holds, too few samples
  to fill every DP rank), at the smallest larger group size that divides the domain and can. A
  plan of one CP size either way; DCP's own plan only where no size can.
- **How it reaches the planner.** It replaces ``default_dynamic_cp`` in the scheduler registry
  (``scheduling.SCHEDULERS``, which ``build_scheduler`` reads at every call), so DCPConfig, the
  RL adapter and megatron-core dev's scheduler interface (verl's path) all plan with it.
  ``tests/conftest.py`` installs it before any test runs when the variable is set; the
  distributed harness forks its workers, which inherit it. A training job started with torchrun
  (functional tests, ``test_sft_run.py``) runs its entry point through this module instead
  (:func:`launch_entry`): ``python -m megatron_dcp.testing.force_static_plan pretrain_gpt ARGS``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Sequence, Tuple

from megatron_dcp.scheduling import SCHEDULERS
from megatron_dcp.scheduling.dynamic_cp.scheduler import DefaultDynamicCPScheduler
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.plan import MicroBatch

SWITCH = "MEGATRON_DCP_FORCE_STATIC_PLAN"
THIS_MODULE = "testing.force_static_plan"


class StaticPlanScheduler(DefaultDynamicCPScheduler):
    """``default_dynamic_cp`` that returns the static plan (module docstring). Not registered
    under a name of its own: :func:`force_static_plans` puts it in DCP's place."""

    def _schedule(self, seqlens: tuple, patches: Tuple[int, ...] = ()) -> List[MicroBatch]:
        domain = self.domain
        sizes = [s for s in domain.group_sizes if s >= domain.cp_size and domain.size % s == 0]
        for size in sizes:
            try:
                plan = self.static_scheduler(size).schedule(seqlens, patches or None)
            except SchedulingError:
                continue
            return list(plan.microbatches)
        return super()._schedule(seqlens, patches)


def switched_on() -> bool:
    return os.environ.get(SWITCH, "") not in ("", "0")


def force_static_plans() -> None:
    """Plan every later ``default_dynamic_cp`` scheduler with :class:`StaticPlanScheduler`."""
    SCHEDULERS[DefaultDynamicCPScheduler.name] = StaticPlanScheduler


def launch_entry(entry: str, args: Sequence[str]) -> Tuple[str, List[str]]:
    """The entry point and arguments a torchrun job of ``megatron_dcp.<entry>`` is launched with:
    unchanged, or through this module when the switch is on."""
    if switched_on():
        return THIS_MODULE, [entry, *args]
    return entry, list(args)


def main() -> None:
    """``python -m megatron_dcp.testing.force_static_plan ENTRY ARGS...``: run
    ``megatron_dcp.ENTRY`` as ``__main__`` with ARGS, the planner forced to the static plan."""
    entry = sys.argv.pop(1)
    force_static_plans()
    runpy.run_module(f"megatron_dcp.{entry}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
