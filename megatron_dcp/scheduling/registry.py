"""Scheduler base class and registry: a scheduler registers itself by subclassing with a name."""

from __future__ import annotations

import gc
import operator
from contextlib import contextmanager
from typing import ClassVar, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Type

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

    A scheduler that prices vision work sets ``prices_patches`` and implements
    ``_schedule(seqlens, patches)`` (``patches``: one count per sample, not all 0); the others
    are called as ``_schedule(seqlens)`` and plan blind to the patches (their plans still carry
    them, so every figure prices them).
    """

    name: ClassVar[str] = ""
    prices_patches: ClassVar[bool] = False

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

    def schedule(
        self, seqlens: Iterable[int], patches: Optional[Iterable[int]] = None
    ) -> Plan:
        """Plan one global batch; sample id = index in ``seqlens``. ``patches``: each sample's
        vision-encoder patches (None: a text batch; all 0 is the same, and the plan then holds
        none). Deterministic in its input."""
        lengths = self.domain.check_seqlens(seqlens)
        counts = check_patches(patches, len(lengths))
        with collector_paused():
            microbatches = self._plan_part(lengths, counts) if lengths else []
            if self.max_samples_per_group is not None:

                def replan(ids: Sequence[int]) -> List[MicroBatch]:
                    part = tuple(counts[i] for i in ids) if counts else ()
                    return self._plan_part(tuple(lengths[i] for i in ids), part)

                microbatches = capped(microbatches, lengths, self.max_samples_per_group, replan)
        plan = Plan(
            lengths,
            self.domain,
            tuple(microbatches),
            self.microbatch_group_size_per_vp_stage,
            self.max_samples_per_group,
            counts,
        )
        return plan.validate()

    def _plan_part(self, seqlens: tuple, patches: Tuple[int, ...]) -> List[MicroBatch]:
        """:meth:`_schedule` of these samples, given their patches where it prices them."""
        if patches and any(patches) and self.prices_patches:
            return self._schedule(seqlens, patches)  # type: ignore[call-arg]
        return self._schedule(seqlens)

    def _schedule(self, seqlens: tuple) -> List[MicroBatch]:
        raise NotImplementedError


def check_patches(patches: Optional[Iterable[int]], count: int) -> Tuple[int, ...]:
    """``patches`` as a tuple of non-negative ints, one per sample (``count``); the empty tuple
    for None or all 0. A SchedulingError naming ``patches`` otherwise."""
    if patches is None:
        return ()
    values = tuple(patches)
    if len(values) != count:
        raise SchedulingError(
            "{patches}: {given} counts for {count} samples; give one per sample (or None).",
            given=len(values),
            count=count,
        )
    checked = []
    for sample_id, value in enumerate(values):
        try:
            number = operator.index(value)
        except TypeError:
            number = -1
        if number < 0 or isinstance(value, bool):
            raise SchedulingError(
                "{patches}[{sample_id}]={value!r}: encoder patches must be non-negative integers.",
                sample_id=sample_id,
                value=value,
            )
        checked.append(number)
    return tuple(checked) if any(checked) else ()


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
