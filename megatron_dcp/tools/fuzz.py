"""Randomised differential checking of the schedulers against an independent plan checker.

Every case draws a domain (any N = dp·cp in 1..64, a power-of-two minimum CP size, an optional VPP
group size, a budget) and 0–300 lengths (tiny, typical and near-maximal), runs each scheduler and
checks the plan with :func:`check_plan`, which re-derives every invariant of DESIGN.md from the raw
fields of the plan without using :meth:`Plan.validate` or :class:`Domain` helpers. Inputs that a
scheduler must or may reject (:func:`rejection`) must raise ``ValueError`` and nothing else; a
rejection of an input that provably has a plan is a violation. Failures are shrunk to a short
reproducer. Pure Python; run ``python -m megatron_dcp.tools.fuzz --cases 20000 --jobs 2``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.domain import Domain
from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.plan import InvalidPlanError, Plan
from megatron_dcp.scheduling.registry import Scheduler, build_scheduler

MAX_DOMAIN = 64
MAX_SEQUENCES = 300
MAX_BUDGET = 4096
STORED_VIOLATIONS = 20
STORED_PER_KIND = 4  # so that rarer kinds of violation get reproducers too
SHRINK_CALLS = 400
MESSAGE_CHARS = 160

# Outcomes of the feasibility oracle (see :func:`rejection`).
MUST_REJECT = "must reject"
MAY_REJECT = "may reject"


# --------------------------------------------------------------------------------------------
# The independent checker
# --------------------------------------------------------------------------------------------


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _group_shape_ok(start: int, size: int, n: int, min_cp: int) -> bool:
    """A communicator exists for ``[start, start + size)``: the whole domain, or an aligned
    power-of-two block of at least ``min_cp`` ranks inside the domain."""
    if start == 0 and size == n:
        return True
    return _pow2(size) and size >= min_cp and start % size == 0 and start + size <= n


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
# Cases and the feasibility oracle
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One scheduler input: the domain settings and the lengths."""

    dp_size: int
    cp_size: int
    budget: int
    min_cp_size: int
    vpp: Optional[int]
    seqlens: Tuple[int, ...]

    @property
    def size(self) -> int:
        return self.dp_size * self.cp_size

    def kwargs(self) -> dict:
        return dict(
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            max_seqlen_per_dp_cp_rank=self.budget,
            min_cp_size=self.min_cp_size,
            microbatch_group_size_per_vp_stage=self.vpp,
        )

    def domain(self) -> Domain:
        return Domain(self.dp_size, self.cp_size, self.budget, self.min_cp_size)

    def reproducer(self, name: str) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs().items())
        lengths = list(self.seqlens)
        text = f"build_scheduler({name!r}, {args}).schedule({lengths})"
        if len(text) > 600:
            shown = f"{lengths[:40]} + ...{len(lengths)} total"
            text = f"build_scheduler({name!r}, {args}).schedule({shown})"
        return text


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


def rejection(name: str, case: Case) -> Optional[str]:
    """Whether ``name`` must, may, or must not (None) reject ``case`` with ``ValueError``.

    A plan exists iff the lengths fit in K non-empty bins for some allowed bin count ≤ K: bins are
    whole micro-batches of N·budget tokens for ``default_dynamic_cp`` (the whole-domain group
    always exists) and static CP blocks of cp·budget tokens, dp per micro-batch, for
    ``dp_balanced``. Splitting a bin never breaks capacity, so fewer bins than K can always be
    padded to K. Bin packing is hard, so the answer is "may" between its lower and upper bounds.
    """
    n, seqlens, cp = case.size, case.seqlens, case.cp_size
    if name == "dp_balanced" and not (cp == n or (_pow2(cp) and cp >= case.min_cp_size)):
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


def _bins(name: str, case: Case) -> Tuple[int, int]:
    """(tokens per bin, most bins a plan may have) for the schedulers :func:`rejection` knows."""
    count = len(case.seqlens)
    if name == "dp_balanced":
        microbatches = _largest_aligned(count // case.dp_size, case.vpp)
        return case.cp_size * case.budget, case.dp_size * microbatches
    return case.size * case.budget, _largest_aligned(count, case.vpp)


def draw_domain(rng: random.Random) -> Tuple[int, int, int, int, Optional[int]]:
    """(dp, cp, budget, min_cp, vpp): N in 1..64 (odd and non-powers of two often)."""
    n = rng.choice((rng.randint(1, MAX_DOMAIN), rng.randint(1, 12), 1 << rng.randint(0, 6)))
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    pow2_divisors = [d for d in divisors if _pow2(d)]
    cp = rng.choice(pow2_divisors) if rng.random() < 0.6 else rng.choice(divisors)
    pow2s = [1 << k for k in range(n.bit_length()) if 1 << k <= n]
    min_cp = 1 if rng.random() < 0.5 else rng.choice(pow2s)
    vpp = None if rng.random() < 0.5 else rng.randint(1, 4)
    budget = rng.choice((rng.randint(1, 16), rng.randint(1, MAX_BUDGET), 1 << rng.randint(0, 12)))
    return n // cp, cp, budget, min_cp, vpp


def draw_lengths(rng: random.Random, n: int, budget: int) -> Tuple[int, ...]:
    """0–300 lengths, mostly short lists; a per-case mixture of tiny, typical and near-max."""
    count = rng.choice((rng.randint(0, 8), rng.randint(0, 40), rng.randint(0, MAX_SEQUENCES)))
    cap = n * budget
    weights = [rng.random() for _ in range(4)]
    kinds = rng.choices(("tiny", "typical", "large", "max"), weights=weights, k=count)
    lengths = []
    for kind in kinds:
        if kind == "tiny":
            lengths.append(rng.randint(0, 3))
        elif kind == "typical":
            lengths.append(rng.randint(1, budget))
        elif kind == "large":
            lengths.append(rng.randint(1, cap))
        else:
            lengths.append(max(0, cap - rng.randint(0, 2)))
    if count and rng.random() < 0.05:
        lengths[rng.randrange(count)] = cap + rng.randint(1, budget)  # must be rejected
    return tuple(min(length, cap + budget) for length in lengths)


def draw_case(seed: int, index: int) -> Case:
    """Case ``index`` of the run with ``seed`` (independent of the other cases)."""
    rng = random.Random(seed * 1_000_003 + index)
    dp, cp, budget, min_cp, vpp = draw_domain(rng)
    return Case(dp, cp, budget, min_cp, vpp, draw_lengths(rng, dp * cp, budget))


# --------------------------------------------------------------------------------------------
# Running one case
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What scheduling one case gave: a plan (``microbatches`` ≥ 0) or a rejection (None), and
    the problems found (empty when the scheduler behaved)."""

    microbatches: Optional[int]
    problems: Tuple[str, ...] = ()

    @property
    def planned(self) -> bool:
        return self.microbatches is not None


VERDICTS = {None: "has a plan", MUST_REJECT: "has no plan", MAY_REJECT: "may have no plan"}


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def run_case(name: str, case: Case) -> Outcome:
    """Schedule ``case`` with ``name`` and judge the result against :func:`check_plan` and the
    feasibility oracle :func:`rejection`."""
    expected = rejection(name, case)
    try:
        scheduler = build_scheduler(name, **case.kwargs())
        plan = scheduler.schedule(list(case.seqlens))
    except InvalidPlanError as error:  # a ValueError, but the scheduler's fault
        return Outcome(None, (f"schedule() built an invalid plan: {_short(error)}",))
    except ValueError as error:
        if expected is None:
            return Outcome(None, (f"ValueError on an input that has a plan: {_short(error)}",))
        if not isinstance(error, SchedulingError):
            return Outcome(None, (f"ValueError is no SchedulingError: {_short(error)}",))
        return Outcome(None)
    except Exception as error:  # noqa: BLE001 - any other exception is the finding
        verdict = VERDICTS[expected]
        return Outcome(
            None, (f"{type(error).__name__} on an input that {verdict}: {_short(error)}",)
        )
    problems = plan_problems(name, case, scheduler, plan)
    if expected == MUST_REJECT:
        problems.insert(0, "accepted an input that has no plan (must raise ValueError)")
    return Outcome(plan.num_microbatches, tuple(problems))


def plan_problems(name: str, case: Case, scheduler: Scheduler, plan: Plan) -> List[str]:
    """:func:`check_plan` (+ static CP for ``dp_balanced``), ``validate()`` and determinism."""
    problems = check_plan(plan, case.seqlens, case.domain(), case.vpp)
    if name == "dp_balanced":
        problems += check_static_cp(plan, case.cp_size)
    try:
        plan.validate()
    except Exception as error:  # noqa: BLE001
        problems.append(f"validate() raised {_short(error)}")
    try:
        again = scheduler.schedule(list(case.seqlens))
    except Exception as error:  # noqa: BLE001
        return problems + [f"second schedule() raised {_short(error)}"]
    if again != plan or repr(again) != repr(plan):
        problems.append("not deterministic: scheduling the same lengths again gave another plan")
    return problems


def problem_kind(problem: str) -> str:
    """A problem's class, for counting and shrinking: its text up to the first colon, digits
    masked."""
    return "".join("#" if ch.isdigit() else ch for ch in problem.split(":")[0])


class _Budgeted:
    """A failure predicate that answers False once it has been called ``budget`` times."""

    def __init__(self, fails: Callable[[Case], bool], budget: int) -> None:
        self.fails, self.left = fails, budget

    def __call__(self, case: Case) -> bool:
        self.left -= 1
        return self.left >= 0 and self.fails(case)


def shrink(case: Case, fails: Callable[[Case], bool], budget: int = SHRINK_CALLS) -> Case:
    """A smaller case that still ``fails``: simpler domain settings, fewer lengths, smaller
    lengths (greedy, at most ``budget`` calls of ``fails``)."""
    still_fails = _Budgeted(fails, budget)
    current = case
    for candidate in _simpler_domains(current):
        if still_fails(candidate):
            current = candidate
    current = _drop_lengths(current, still_fails)
    return _lower_lengths(current, still_fails)


def _lower_lengths(case: Case, still_fails: _Budgeted) -> Case:
    """Lower single lengths (to 0, 1, half, ...) while the case still fails."""
    current, changed = case, True
    while changed and still_fails.left > 0:
        changed = False
        for i in range(len(current.seqlens)):
            for value in _smaller_values(current.seqlens[i]):
                candidate = replace(
                    current, seqlens=current.seqlens[:i] + (value,) + current.seqlens[i + 1 :]
                )
                if still_fails(candidate):
                    current, changed = candidate, True
                    break
    return current


def _simpler_domains(case: Case) -> List[Case]:
    """Variants with one setting simplified: no VPP, min CP 1, DP-only or CP-only layout."""
    variants = [replace(case, vpp=None), replace(case, min_cp_size=1)]
    variants += [
        replace(case, dp_size=case.size, cp_size=1),
        replace(case, dp_size=1, cp_size=case.size),
    ]
    return [v for v in variants if v != case]


def _drop_lengths(case: Case, still_fails: Callable[[Case], bool]) -> Case:
    """Remove chunks of lengths (halving the chunk size) while the case still fails."""
    current, chunk = case, max(1, len(case.seqlens) // 2)
    while chunk >= 1:
        start, progress = 0, False
        while start < len(current.seqlens):
            lengths = current.seqlens[:start] + current.seqlens[start + chunk :]
            if still_fails(replace(current, seqlens=lengths)):
                current, progress = replace(current, seqlens=lengths), True
            else:
                start += chunk
        if not progress:
            chunk //= 2
    return current


def _smaller_values(value: int) -> List[int]:
    return sorted({v for v in (0, 1, value // 2, value * 3 // 4, value - 1) if 0 <= v < value})


# --------------------------------------------------------------------------------------------
# The fuzz loop
# --------------------------------------------------------------------------------------------


@dataclass
class SchedulerCounts:
    """Per-scheduler tallies."""

    planned: int = 0
    skipped_invalid: int = 0
    violations: int = 0
    microbatches: int = 0

    def merge(self, other: "SchedulerCounts") -> None:
        self.planned += other.planned
        self.skipped_invalid += other.skipped_invalid
        self.violations += other.violations
        self.microbatches += other.microbatches


@dataclass
class FuzzResult:
    """Outcome of :func:`run_fuzz`. ``violation_count`` counts every violation; reproducers (shrunk)
    are kept for at most ``STORED_PER_KIND`` violations of each kind, ``STORED_VIOLATIONS`` in all.
    """

    cases: int
    per_scheduler: Dict[str, SchedulerCounts] = field(default_factory=dict)
    skipped_invalid: int = 0
    violation_count: int = 0
    seconds: float = 0.0
    kinds: Dict[str, int] = field(default_factory=dict)
    reproducers: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.violation_count == 0

    @property
    def violations(self) -> List[str]:
        """The stored reproducers, kinds taking turns (first of each kind first)."""
        rounds = zip_longest(*self.reproducers.values())
        return [text for round_ in rounds for text in round_ if text is not None]

    def wants_reproducer(self, kind: str) -> bool:
        stored = sum(map(len, self.reproducers.values()))
        return stored < STORED_VIOLATIONS and len(self.reproducers.get(kind, ())) < STORED_PER_KIND

    def add_violation(self, text: str, kind: str = "") -> None:
        self.violation_count += 1
        if self.wants_reproducer(kind):
            self.reproducers.setdefault(kind, []).append(text)

    def merge(self, other: "FuzzResult") -> None:
        self.cases += other.cases
        self.skipped_invalid += other.skipped_invalid
        self.violation_count += other.violation_count
        for name, counts in other.per_scheduler.items():
            self.per_scheduler.setdefault(name, SchedulerCounts()).merge(counts)
        for kind, count in other.kinds.items():
            self.kinds[kind] = self.kinds.get(kind, 0) + count
        for kind, texts in other.reproducers.items():
            for text in texts:
                if self.wants_reproducer(kind):
                    self.reproducers.setdefault(kind, []).append(text)

    def summary(self) -> str:
        lines = [
            f"cases={self.cases} violations={self.violation_count} "
            f"skipped_invalid={self.skipped_invalid} seconds={self.seconds:.1f} "
            f"rate={self.cases / self.seconds if self.seconds else 0:.1f} cases/s"
        ]
        for name, c in sorted(self.per_scheduler.items()):
            lines.append(
                f"  {name}: planned={c.planned} skipped_invalid={c.skipped_invalid} "
                f"violations={c.violations} microbatches={c.microbatches}"
            )
        lines += [f"  {count:>6} x {kind}" for kind, count in sorted(self.kinds.items())]
        lines += [f"  VIOLATION {text}" for text in self.violations]
        return "\n".join(lines)


def run_fuzz(
    cases: int,
    seed: int = 0,
    schedulers: Sequence[str] = ("default_dynamic_cp", "dp_balanced"),
    first_case: int = 0,
    progress: Optional[Callable[[int, FuzzResult], None]] = None,
) -> FuzzResult:
    """Run cases ``first_case .. first_case + cases - 1`` of ``seed`` on every scheduler."""
    result = FuzzResult(cases=0, per_scheduler={name: SchedulerCounts() for name in schedulers})
    started = time.perf_counter()
    for index in range(first_case, first_case + cases):
        case = draw_case(seed, index)
        for name in schedulers:
            _record(result, name, case, seed, index)
        result.cases += 1
        if progress is not None:
            progress(index, result)
    result.seconds = time.perf_counter() - started
    return result


def _record(result: FuzzResult, name: str, case: Case, seed: int, index: int) -> None:
    counts = result.per_scheduler[name]
    outcome = run_case(name, case)
    if not outcome.problems:
        if outcome.planned:
            counts.planned += 1
            counts.microbatches += outcome.microbatches
        else:
            counts.skipped_invalid += 1
            result.skipped_invalid += 1
        return
    counts.violations += 1
    kind = problem_kind(outcome.problems[0])
    result.kinds[f"{name}: {kind}"] = result.kinds.get(f"{name}: {kind}", 0) + 1
    if not result.wants_reproducer(f"{name}: {kind}"):
        result.violation_count += 1  # counted, not stored: only stored ones are worth shrinking
        return
    small = shrink(case, lambda c: any(problem_kind(p) == kind for p in run_case(name, c).problems))
    detail = "; ".join(run_case(name, small).problems[:2]) or "; ".join(outcome.problems[:2])
    text = f"[seed {seed} case {index}] {name}: {detail} | {small.reproducer(name)}"
    result.add_violation(text, f"{name}: {kind}")


def _worker(args: Tuple[int, int, int, Tuple[str, ...], int]) -> FuzzResult:
    cases, seed, first, schedulers, every = args
    started = time.perf_counter()

    def progress(index: int, result: FuzzResult) -> None:
        if every and result.cases % every == 0:
            print(
                f"[cases {first}..{index}] {result.cases} done, "
                f"{result.violation_count} violations, {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    return run_fuzz(cases, seed, schedulers, first_case=first, progress=progress)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (cases split evenly)")
    parser.add_argument("--schedulers", nargs="+", default=["default_dynamic_cp", "dp_balanced"])
    parser.add_argument("--progress", type=int, default=0, help="log every this many cases")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    names = tuple(args.schedulers)
    chunks = [
        (args.cases * j // args.jobs, args.cases * (j + 1) // args.jobs) for j in range(args.jobs)
    ]
    work = [(stop - start, args.seed, start, names, args.progress) for start, stop in chunks]
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.Pool(args.jobs) as pool:
            parts = pool.map(_worker, work)
    else:
        parts = [_worker(work[0])]
    total = FuzzResult(cases=0)
    for part in parts:
        total.merge(part)
    total.seconds = time.perf_counter() - started
    print(total.summary(), flush=True)
    return 0 if total.ok else 1


if __name__ == "__main__":
    sys.exit(main())
