"""Scheduler base class and registry: a scheduler registers itself by subclassing with a name."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import ClassVar, Dict, Iterable, Iterator, List, Optional, Type

from megatron_dcp.scheduling.cost import CostModel
from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.plan import MicroBatch, Plan
from megatron_dcp.scheduling.sample_cap import capped

SCHEDULERS: Dict[str, Type["Scheduler"]] = {}


class Scheduler:
    """Turns the sequence lengths of one global batch into a validated :class:`Plan`.

    Subclass with ``class MyScheduler(Scheduler, name="my_scheduler")`` to register it; subclasses
    implement :meth:`_schedule` and may assume non-empty, validated lengths.
    ``max_samples_per_group`` caps the samples of one CP group of a micro-batch (None: no cap);
    :meth:`schedule` holds every scheduler's plan to it (``scheduling.sample_cap``).
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, name: str = "", **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name:
            if name in SCHEDULERS:
                raise ValueError(f"a scheduler named {name!r} is already registered")
            cls.name = name
            SCHEDULERS[name] = cls

    def __init__(
        self,
        dp_size: int,
        cp_size: int,
        max_seqlen_per_dp_cp_rank: int,
        min_cp_size: int = 1,
        microbatch_group_size_per_vp_stage: Optional[int] = None,
        cost_model: Optional[CostModel] = None,
        max_samples_per_group: Optional[int] = None,
    ) -> None:
        self.domain = Domain(dp_size, cp_size, max_seqlen_per_dp_cp_rank, min_cp_size)
        self.microbatch_group_size_per_vp_stage = optional_count(
            microbatch_group_size_per_vp_stage, "vpp", "usually the pipeline-parallel size"
        )
        self.max_samples_per_group = optional_count(
            max_samples_per_group, "max_samples", "samples per CP group"
        )
        self.cost_model = cost_model or CostModel.from_model_shape()

    def schedule(self, seqlens: Iterable[int]) -> Plan:
        """Plan one global batch; sample id = index in ``seqlens``. Deterministic in its input."""
        lengths = self.domain.check_seqlens(seqlens)
        with collector_paused():
            microbatches = self._schedule(lengths) if lengths else []
            if self.max_samples_per_group is not None:
                microbatches = capped(
                    microbatches, lengths, self.max_samples_per_group, self._schedule
                )
        plan = Plan(
            lengths,
            self.domain,
            tuple(microbatches),
            self.microbatch_group_size_per_vp_stage,
            self.max_samples_per_group,
        )
        return plan.validate()

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        raise NotImplementedError


def optional_count(value: Optional[int], parameter: str, meaning: str) -> Optional[int]:
    """``value`` when it is None or a positive integer (a bool is not one); otherwise a
    SchedulingError naming the ``parameter`` placeholder and what the count means."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SchedulingError(
            "{%s}={value!r}: must be a positive integer (%s)." % (parameter, meaning), value=value
        )
    return value


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a plan is made, then restored as it was.

    Planning allocates many short-lived objects that reference counting frees; in a training
    process the collector would otherwise run full collections over the whole heap (megatron,
    torch: hundreds of thousands of objects) a few times per plan, which at N = 4,096 costs as
    much as the planning itself. A collector already off (megatron's ``--manual-gc``) stays off.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_scheduler(name: str, **kwargs) -> Scheduler:
    """Build the scheduler registered as ``name`` (see :data:`SCHEDULERS`)."""
    if name not in SCHEDULERS:
        raise SchedulingError(
            "{scheduler}={name!r}: unknown scheduler; choose one of {names}.",
            name=name,
            names=", ".join(sorted(SCHEDULERS)),
        )
    return SCHEDULERS[name](**kwargs)
