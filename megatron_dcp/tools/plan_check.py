"""The independent plan checker and the feasibility oracle of the fuzzer (``tools.plan_fuzzer``).

:func:`check_plan` re-derives every plan invariant (docs/architecture.md) from the raw fields of a
plan, without :meth:`Plan.validate` or :class:`Domain` helpers, so that a bug shared by the schedulers
and the validator still shows. :func:`rejection` says whether a scheduler must, may or must not
reject an input with ``ValueError``.
"""

from __future__ import annotations

from collections import Counter
from typing import List, Optional, Protocol, Sequence, Tuple

from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.plan import Plan

# Outcomes of the feasibility oracle (see :func:`rejection`).
MUST_REJECT = "must reject"
MAY_REJECT = "may reject"


# --------------------------------------------------------------------------------------------
# The independent checker
# --------------------------------------------------------------------------------------------


def is_pow2(value: int) -> bool:
    """True for 1, 2, 4, ... (re-derived here, not taken from the scheduling package)."""
    return value > 0 and value & (value - 1) == 0


def _group_shape_ok(start: int, size: int, n: int, min_cp: int) -> bool:
    """A communicator exists for ``[start, start + size)``: the whole domain, or an aligned
    power-of-two block of at least ``min_cp`` ranks inside the domain."""
    if start == 0 and size == n:
        return True
    return is_pow2(size) and size >= min_cp and start % size == 0 and start + size <= n


def check_header(
    plan: Plan, seqlens: Sequence[int], domain: Domain, vpp: Optional[int]
) -> List[str]:
    """The plan describes this input, domain and VPP setting."""
    errors = []
    if tuple(plan.seqlens) != tuple(seqlens):
        errors.append("plan.seqlens differ from the input lengths")
    if plan.domain != domain:
        errors.append(f"plan.domain {plan.domain} != {domain}")
    if plan.microbatch_group_size_per_vp_stage != vpp:
        errors.append(f"plan VPP size {plan.microbatch_group_size_per_vp_stage} != {vpp}")
    return errors


def check_coverage(plan: Plan, seqlens: Sequence[int]) -> List[str]:
    """Every sample id appears in exactly one group of exactly one micro-batch."""
    seen = Counter(i for mb in plan.microbatches for g in mb.groups for i in g.sample_ids)
    errors = []
    missing = [i for i in range(len(seqlens)) if seen[i] == 0]
    repeated = sorted(i for i, n in seen.items() if n > 1)
    unknown = sorted(i for i in seen if not (isinstance(i, int) and 0 <= i < len(seqlens)))
    for what, ids in (("missing", missing), ("repeated", repeated), ("unknown", unknown)):
        if ids:
            errors.append(f"samples {what}: {ids[:5]}")
    return errors


def check_partition(plan: Plan, n: int) -> List[str]:
    """The groups of every micro-batch partition the positions 0..N-1."""
    errors = []
    for index, mb in enumerate(plan.microbatches):
        ranks = sorted(r for g in mb.groups for r in g.ranks)
        if ranks != list(range(n)):
            errors.append(f"mb {index}: groups do not partition 0..{n - 1}: {ranks[:12]}")
    return errors


def check_group_shapes(plan: Plan, n: int, min_cp: int) -> List[str]:
    """Every group is a contiguous aligned block for which a CP group exists."""
    errors = []
    for index, mb in enumerate(plan.microbatches):
        for g in mb.groups:
            ranks = tuple(g.ranks)
            if not ranks:
                errors.append(f"mb {index}: a group has no ranks")
                continue
            start, size = ranks[0], len(ranks)
            if ranks != tuple(range(start, start + size)) or not _group_shape_ok(
                start, size, n, min_cp
            ):
                errors.append(f"mb {index}: group ranks {ranks[:8]} not a CP-group block")
    return errors


def check_budget(plan: Plan, seqlens: Sequence[int], budget: int) -> List[str]:
    """Σ len / |group| ≤ budget in every group (exact integer arithmetic)."""
    errors = []
    for index, mb in enumerate(plan.microbatches):
        for g in mb.groups:
            tokens = sum(seqlens[i] for i in g.sample_ids if 0 <= i < len(seqlens))
            if tokens > budget * max(1, len(g.ranks)):
                errors.append(
                    f"mb {index}: group {g.ranks[:1]}+{len(g.ranks)} holds {tokens} tokens > "
                    f"{len(g.ranks)} x {budget}"
                )
    return errors


def check_no_idle(plan: Plan) -> List[str]:
    """No rank is idle: every group of every micro-batch packs at least one sample."""
    return [
        f"mb {index}: group {g.ranks[:1]}+{len(g.ranks)} is idle"
        for index, mb in enumerate(plan.microbatches)
        for g in mb.groups
        if not g.sample_ids
    ]


def check_vpp(plan: Plan, vpp: Optional[int]) -> List[str]:
    """With VPP the number of micro-batches is a multiple of the group size."""
    count = len(plan.microbatches)
    if vpp and count % vpp:
        return [f"{count} micro-batches is not a multiple of VPP group size {vpp}"]
    return []


def check_static_cp(plan: Plan, cp_size: int) -> List[str]:
    """``dp_balanced`` only: every group is the fixed CP block ``[d·cp, (d+1)·cp)``."""
    return [
        f"mb {index}: group {g.ranks[:4]} is not a static CP{cp_size} block"
        for index, mb in enumerate(plan.microbatches)
        for g in mb.groups
        if len(g.ranks) != cp_size or g.ranks[0] % cp_size
    ]


def check_plan(plan: Plan, seqlens: Sequence[int], domain: Domain, vpp: Optional[int]) -> List[str]:
    """Every violated plan invariant, as short messages (empty when the plan is valid).

    Re-derives the invariants from the plan's raw fields and ``domain``'s four settings only.
    """
    n, budget, min_cp = (
        domain.dp_size * domain.cp_size,
        domain.max_seqlen_per_dp_cp_rank,
        domain.min_cp_size,
    )
    return (
        check_header(plan, seqlens, domain, vpp)
        + check_coverage(plan, seqlens)
        + check_partition(plan, n)
        + check_group_shapes(plan, n, min_cp)
        + check_budget(plan, seqlens, budget)
        + check_no_idle(plan)
        + check_vpp(plan, vpp)
    )


# --------------------------------------------------------------------------------------------
# The feasibility oracle
# --------------------------------------------------------------------------------------------


class SchedulerInput(Protocol):
    """What the oracle reads of one scheduler input (``tools.plan_fuzzer.FuzzCase`` is one)."""

    @property
    def dp_size(self) -> int: ...

    @property
    def cp_size(self) -> int: ...

    @property
    def budget(self) -> int: ...

    @property
    def min_cp_size(self) -> int: ...

    @property
    def vpp(self) -> Optional[int]: ...

    @property
    def seqlens(self) -> Tuple[int, ...]: ...

    @property
    def size(self) -> int: ...


def min_bins_bounds(seqlens: Sequence[int], capacity: int) -> Tuple[int, int]:
    """(lower, upper) bounds on the fewest bins of ``capacity`` tokens that hold ``seqlens``:
    max(⌈Σ/C⌉, #items > C/2) and first-fit decreasing."""
    if not seqlens:
        return 0, 0
    lower = max(-(-sum(seqlens) // capacity), sum(1 for s in seqlens if 2 * s > capacity))
    free: List[int] = []
    for s in sorted(seqlens, reverse=True):
        for i, room in enumerate(free):
            if s <= room:
                free[i] -= s
                break
        else:
            free.append(capacity - s)
    return lower, len(free)


def _largest_aligned(limit: int, vpp: Optional[int]) -> int:
    """The largest multiple of ``vpp`` (any count without VPP) that is ≤ ``limit``."""
    return limit - limit % vpp if vpp else limit


def rejection(name: str, case: SchedulerInput) -> Optional[str]:
    """Whether ``name`` must, may, or must not (None) reject ``case`` with ``ValueError``.

    A plan exists iff the lengths fit in K non-empty bins for some allowed bin count ≤ K: bins are
    whole micro-batches of N·budget tokens for ``default_dynamic_cp`` (the whole-domain group
    always exists) and static CP blocks of cp·budget tokens, dp per micro-batch, for
    ``dp_balanced``. Splitting a bin never breaks capacity, so fewer bins than K can always be
    padded to K. Bin packing is hard, so the answer is "may" between its lower and upper bounds.
    """
    n, seqlens, cp = case.size, case.seqlens, case.cp_size
    if name == "dp_balanced" and not (cp == n or (is_pow2(cp) and cp >= case.min_cp_size)):
        return MUST_REJECT  # no static CP group of cp_size ranks exists
    if any(s > n * case.budget for s in seqlens):
        return MUST_REJECT
    if not seqlens:
        return None
    if name not in ("dp_balanced", "default_dynamic_cp"):
        return MAY_REJECT
    capacity, bins = _bins(name, case)
    if bins == 0 or any(s > capacity for s in seqlens):
        return MUST_REJECT
    lower, upper = min_bins_bounds(seqlens, capacity)
    if lower > bins:
        return MUST_REJECT
    return None if upper <= bins else MAY_REJECT


def _bins(name: str, case: SchedulerInput) -> Tuple[int, int]:
    """(tokens per bin, most bins a plan may have) for the schedulers :func:`rejection` knows."""
    count = len(case.seqlens)
    if name == "dp_balanced":
        microbatches = _largest_aligned(count // case.dp_size, case.vpp)
        return case.cp_size * case.budget, case.dp_size * microbatches
    return case.size * case.budget, _largest_aligned(count, case.vpp)
