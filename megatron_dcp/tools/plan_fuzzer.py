"""Randomised differential checking of the schedulers against an independent plan checker.

Every case draws a domain (any N = dp·cp in 1..64, a power-of-two minimum CP size, an optional VPP
group size, a budget) and 0–300 lengths (tiny, typical and near-maximal), runs each scheduler and
checks the plan with :func:`~megatron_dcp.tools.plan_check.check_plan`, which re-derives every
plan invariant (docs/architecture.md) from the raw fields of the plan without using
:meth:`Plan.validate` or :class:`Domain` helpers, and checks that the lower bound is not above the
plan's critical path. Inputs that a scheduler must or may reject
(:func:`~megatron_dcp.tools.plan_check.rejection`) must raise ``ValueError`` and nothing else; a
rejection of an input that provably has a plan is a violation. Failures are shrunk to a short
reproducer. Pure Python; run ``python -m megatron_dcp.tools.plan_fuzzer --cases 20000 --jobs 2``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_dcp.scheduling.errors import SchedulingError
from megatron_dcp.scheduling.metrics import critical_path, lower_bound
from megatron_dcp.scheduling.plan import InvalidPlanError, Plan
from megatron_dcp.scheduling.registry import Scheduler, build_scheduler
from megatron_dcp.tools.fuzz_cases import FuzzCase, draw_case
from megatron_dcp.tools.plan_check import (
    MAY_REJECT,
    MUST_REJECT,
    check_plan,
    check_static_cp,
    rejection,
)

STORED_VIOLATIONS = 20
STORED_PER_KIND = 4  # so that rarer kinds of violation get reproducers too
SHRINK_CALLS = 400
MESSAGE_CHARS = 160


# --------------------------------------------------------------------------------------------
# Running one case
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseVerdict:
    """What scheduling one case gave: a plan (``microbatches`` ≥ 0) or a rejection (None), and
    the problems found (empty when the scheduler behaved)."""

    microbatches: Optional[int]
    problems: Tuple[str, ...] = ()

    @property
    def planned(self) -> bool:
        return self.microbatches is not None


# How the oracle words an input, for the message of an unexpected exception.
ORACLE_WORDS = {None: "has a plan", MUST_REJECT: "has no plan", MAY_REJECT: "may have no plan"}


def _short(error: BaseException) -> str:
    """``error`` as one message of at most ``MESSAGE_CHARS`` characters."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def run_case(name: str, case: FuzzCase) -> CaseVerdict:
    """Schedule ``case`` with ``name`` and judge the result against :func:`check_plan` and the
    feasibility oracle :func:`rejection`."""
    expected = rejection(name, case)
    try:
        scheduler = build_scheduler(name, cost_model=case.cost_model(), **case.kwargs())
        plan = scheduler.schedule(list(case.seqlens))
    except InvalidPlanError as error:  # a ValueError, but the scheduler's fault
        return CaseVerdict(None, (f"schedule() built an invalid plan: {_short(error)}",))
    except ValueError as error:
        if expected is None:
            return CaseVerdict(None, (f"ValueError on an input that has a plan: {_short(error)}",))
        if not isinstance(error, SchedulingError):
            return CaseVerdict(None, (f"ValueError is no SchedulingError: {_short(error)}",))
        return CaseVerdict(None)
    except Exception as error:  # noqa: BLE001 - any other exception is the finding
        words = ORACLE_WORDS[expected]
        return CaseVerdict(
            None, (f"{type(error).__name__} on an input that {words}: {_short(error)}",)
        )
    problems = plan_problems(name, case, scheduler, plan)
    if expected == MUST_REJECT:
        problems.insert(0, "accepted an input that has no plan (must raise ValueError)")
    return CaseVerdict(plan.num_microbatches, tuple(problems))


def plan_problems(name: str, case: FuzzCase, scheduler: Scheduler, plan: Plan) -> List[str]:
    """:func:`check_plan` (+ static CP for ``dp_balanced``), ``validate()``, the lower bound
    (never above the critical path) and determinism."""
    problems = check_plan(plan, case.seqlens, case.domain(), case.vpp)
    cost = scheduler.cost_model
    if lower_bound(plan, cost) > critical_path(plan, cost) * (1 + 1e-9):
        problems.append("the lower bound is above the plan's critical path")
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


# --------------------------------------------------------------------------------------------
# Shrinking
# --------------------------------------------------------------------------------------------


class _Budgeted:
    """A failure predicate that answers False once it has been called ``budget`` times."""

    def __init__(self, fails: Callable[[FuzzCase], bool], budget: int) -> None:
        self.fails, self.left = fails, budget

    def __call__(self, case: FuzzCase) -> bool:
        self.left -= 1
        return self.left >= 0 and self.fails(case)


def shrink(
    case: FuzzCase, fails: Callable[[FuzzCase], bool], budget: int = SHRINK_CALLS
) -> FuzzCase:
    """A smaller case that still ``fails``: simpler domain settings, fewer lengths, smaller
    lengths (greedy, at most ``budget`` calls of ``fails``)."""
    still_fails = _Budgeted(fails, budget)
    current = case
    for candidate in _simpler_domains(current):
        if still_fails(candidate):
            current = candidate
    current = _drop_lengths(current, still_fails)
    return _lower_lengths(current, still_fails)


def _lower_lengths(case: FuzzCase, still_fails: _Budgeted) -> FuzzCase:
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


def _simpler_domains(case: FuzzCase) -> List[FuzzCase]:
    """Variants with one setting simplified: no VPP, min CP 1, DP-only or CP-only layout."""
    variants = [replace(case, vpp=None), replace(case, min_cp_size=1)]
    variants += [
        replace(case, dp_size=case.size, cp_size=1),
        replace(case, dp_size=1, cp_size=case.size),
    ]
    return [v for v in variants if v != case]


def _drop_lengths(case: FuzzCase, still_fails: Callable[[FuzzCase], bool]) -> FuzzCase:
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


def _record(result: FuzzResult, name: str, case: FuzzCase, seed: int, index: int) -> None:
    """Tally ``name`` on ``case``; a violation of a kind still short of reproducers is shrunk."""
    counts = result.per_scheduler[name]
    verdict = run_case(name, case)
    if not verdict.problems:
        if verdict.planned:
            counts.planned += 1
            counts.microbatches += verdict.microbatches
        else:
            counts.skipped_invalid += 1
            result.skipped_invalid += 1
        return
    counts.violations += 1
    kind = problem_kind(verdict.problems[0])
    result.kinds[f"{name}: {kind}"] = result.kinds.get(f"{name}: {kind}", 0) + 1
    if not result.wants_reproducer(f"{name}: {kind}"):
        result.violation_count += 1  # counted, not stored: only stored ones are worth shrinking
        return
    small = shrink(case, lambda c: any(problem_kind(p) == kind for p in run_case(name, c).problems))
    detail = "; ".join(run_case(name, small).problems[:2]) or "; ".join(verdict.problems[:2])
    text = f"[seed {seed} case {index}] {name}: {detail} | {small.reproducer(name)}"
    result.add_violation(text, f"{name}: {kind}")


# --------------------------------------------------------------------------------------------
# ``python -m megatron_dcp.tools.plan_fuzzer``: worker processes
# --------------------------------------------------------------------------------------------


def _worker(args: Tuple[int, int, int, Tuple[str, ...], int]) -> FuzzResult:
    """(cases, seed, first case, schedulers, progress interval): one process's share."""
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


def fuzz_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m megatron_dcp.tools.plan_fuzzer``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="random cases (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case generator")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (cases split evenly)")
    names = ["default_dynamic_cp", "dp_balanced"]
    parser.add_argument("--schedulers", nargs="+", default=names, help="schedulers to check")
    parser.add_argument("--progress", type=int, default=0, help="log every this many cases")
    return parser


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    return fuzz_parser().parse_args(argv)


def run_jobs(cases: int, seed: int, jobs: int, names: Tuple[str, ...], every: int) -> FuzzResult:
    """``cases`` cases split evenly over ``jobs`` worker processes (in this one when 1), merged."""
    chunks = [(cases * j // jobs, cases * (j + 1) // jobs) for j in range(jobs)]
    work = [(stop - start, seed, start, names, every) for start, stop in chunks]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.Pool(jobs) as pool:
            parts = pool.map(_worker, work)
    else:
        parts = [_worker(work[0])]
    total = FuzzResult(cases=0)
    for part in parts:
        total.merge(part)
    return total


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_dcp.tools.plan_fuzzer``: print the summary; exit 1 on any violation."""
    args = parse_args(argv)
    started = time.perf_counter()
    total = run_jobs(args.cases, args.seed, args.jobs, tuple(args.schedulers), args.progress)
    total.seconds = time.perf_counter() - started
    print(total.summary(), flush=True)
    return 0 if total.ok else 1


if __name__ == "__main__":
    sys.exit(main())
