#!/usr/bin/env python
"""Mutation check: would a wrong line be caught by the test suite?

A curated list of single-line mutations (``MUTANTS`` in ``scripts/mutation_list.py``, with
``mutation_list_tools.py`` and ``mutation_list_rl.py``): realistic one-line mistakes
(off-by-one, wrong group, dropped term, swapped operands, a guard disabled) in the runtime,
the number-changing entries of the patch table, the loss and token-count normalisation and the
plan validation. Each names its file, the exact original snippet (it must
occur exactly once, so the list cannot rot silently), the replacement and the tests a developer
would expect to catch it. For each mutant the check

1. writes the mutated file (its bytecode is never cached: ``PYTHONDONTWRITEBYTECODE=1``),
2. runs ``pytest -x -q -p no:cacheprovider`` on the mutant's tests, in its own process session,
   killed as a whole after ``--timeout`` seconds,
3. puts the original bytes (and time stamps) back whatever happens (an error, Ctrl-C, SIGTERM)
   and checks them by SHA-256,

and reports the mutant killed (with the first failing test's node id, or the time-out) or
survived. A kill counts once the killing test passes on the original code (``--no-confirm``
skips that; a test failing there too, e.g. gloo's start-up flaking under load, proves nothing:
the mutant is tried once more, then reported as an error). Before the mutants it runs each
distinct selection once unmutated (``--no-baseline`` skips that): a selection that fails on the
real code would "kill" every mutant.

    python scripts/mutation_check.py                 # every mutant (minutes on 2 cores)
    python scripts/mutation_check.py --list          # the list, nothing run
    python scripts/mutation_check.py --only packing-zigzag-mirror --json out.json

Exit status: 0 every mutant killed, 1 some survived, 2 the check could not judge (a snippet that
no longer matches, a selection that fails unmutated or collects nothing, a restore mismatch).
Not part of ``.ci/run`` or ``scripts/run_tests.sh``; tests/README.md ("Mutation check") holds the
last result. ``tests/unit/test_mutation_check.py`` keeps the list valid inside the suite.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutation_list import MUTANTS, Mutant  # noqa: E402

PYTEST_FLAGS = ("-x", "-q", "-p", "no:cacheprovider")
DEFAULT_TIMEOUT_S = 300
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


class MutationListError(ValueError):
    """A mutant that no longer fits its file (snippet absent or repeated, no change, bad syntax)."""


class RestoreError(RuntimeError):
    """A mutated file whose original bytes could not be put back."""


@dataclass(frozen=True)
class Outcome:
    """What one pytest run said: ``passed`` (returncode 0), ``failed`` (a test failed or errored,
    ``first`` names it), ``timeout``, or ``broken`` (usage error, nothing collected...)."""

    verdict: str
    first: str
    seconds: float
    tail: str = ""


Runner = Callable[[Sequence[str], float, Path], Outcome]


def mutated_text(mutant: Mutant, root: Path = REPO) -> tuple[bytes, bytes]:
    """The file's bytes and its mutated bytes; refuses a mutant that does not fit exactly."""
    path = root / mutant.path
    if not path.is_file():
        raise MutationListError(f"{mutant.id}: {mutant.path} does not exist")
    data = path.read_bytes()
    text = data.decode("utf-8")
    count = text.count(mutant.original)
    if count != 1:
        raise MutationListError(
            f"{mutant.id}: the original snippet occurs {count} times in {mutant.path} (must be "
            f"exactly once; update the entry in scripts/mutation_list*.py): {mutant.original!r}"
        )
    if mutant.original == mutant.replacement:
        raise MutationListError(f"{mutant.id}: the replacement changes nothing")
    mutated = text.replace(mutant.original, mutant.replacement)
    try:
        ast.parse(mutated, filename=str(path))
    except SyntaxError as error:
        raise MutationListError(f"{mutant.id}: the mutant is a syntax break: {error}") from None
    return data, mutated.encode("utf-8")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def applied(mutant: Mutant, root: Path = REPO) -> Iterator[Path]:
    """The mutant written into its file for the block; the original bytes, time stamps and hash
    are back afterwards, whatever ended the block (an error, Ctrl-C, SIGTERM)."""
    path = root / mutant.path
    original, mutated = mutated_text(mutant, root)
    digest, stat = sha256(original), path.stat()
    try:
        path.write_bytes(mutated)
        # A time stamp unlike the original's: cached bytecode of the original never matches it.
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
        yield path
    finally:
        with signals_held():
            path.write_bytes(original)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        if sha256(path.read_bytes()) != digest:
            raise RestoreError(f"{mutant.path} differs from its original after {mutant.id}")


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block (the restore) is done."""
    signals = (signal.SIGINT, signal.SIGTERM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def run_pytest(tests: Sequence[str], timeout_s: float, root: Path = REPO) -> Outcome:
    """``pytest -x -q -p no:cacheprovider TESTS`` in a new process session (forked ranks and
    torchrun children included), the whole session killed on time-out or interruption."""
    command = [sys.executable, "-m", "pytest", *PYTEST_FLAGS, *tests]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(process)
        output, _ = process.communicate()
        note = f"timeout after {timeout_s:.0f} s"
        return Outcome("timeout", note, elapsed(start), output[-2000:])
    except BaseException:
        kill_session(process)
        process.wait()
        raise
    return outcome_of(process.returncode, output, elapsed(start))


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL to the process group this check started (pytest and its workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def elapsed(start: float) -> float:
    return time.monotonic() - start


def outcome_of(returncode: int, output: str, seconds: float) -> Outcome:
    """pytest's exit status and output as an :class:`Outcome`."""
    tail = output[-2000:]
    first = FAILED_LINE.search(output)
    if returncode == 0:
        return Outcome("passed", "", seconds, tail)
    if returncode in (1, 2) and first:  # 2: interrupted by a collection error the mutant caused
        return Outcome("failed", first.group(1), seconds, tail)
    if returncode < 0:
        return Outcome("failed", f"crash (signal {-returncode})", seconds, tail)
    return Outcome("broken", f"pytest exit status {returncode}", seconds, tail)


@dataclass(frozen=True)
class Result:
    """One mutant's verdict: ``killed``, ``survived`` or ``error``."""

    mutant: Mutant
    status: str
    killed_by: str
    seconds: float


def run_mutant(
    mutant: Mutant,
    timeout_s: float,
    root: Path = REPO,
    runner: Runner = run_pytest,
    confirm: bool = True,
) -> Result:
    """Apply ``mutant``, run its tests, restore the file; the verdict. With ``confirm``, a kill
    counts once the killing test passes unmutated (a test that fails without the mutant, e.g. a
    flaky one, proves nothing); an unconfirmed kill is tried once more, then is an error."""
    seconds, unconfirmed = 0.0, ""
    for _ in range(2):
        with applied(mutant, root):
            outcome = runner(mutant.tests, timeout_s, root)
        seconds += outcome.seconds
        if outcome.verdict == "passed":
            return Result(mutant, "survived", "", seconds)
        if outcome.verdict == "broken":
            print(outcome.tail, file=sys.stderr)
            return Result(mutant, "error", outcome.first, seconds)
        if outcome.verdict == "timeout" or not confirm or not is_test_id(outcome.first):
            return Result(mutant, "killed", outcome.first, seconds)
        if runner((outcome.first,), timeout_s, root).verdict == "passed":
            return Result(mutant, "killed", outcome.first, seconds)
        unconfirmed = outcome.first
    return Result(mutant, "error", f"unconfirmed: {unconfirmed} fails unmutated too", seconds)


def is_test_id(name: str) -> bool:
    """A pytest node id or test file (not a time-out or crash note)."""
    return name.startswith("tests/") or name.startswith("functional_tests/")


def check_baselines(
    mutants: Sequence[Mutant], timeout_s: float, root: Path = REPO, runner: Runner = run_pytest
) -> list[str]:
    """Run each distinct selection unmutated (a failure once more, as gloo's start-up can flake
    under load); the problems (a selection must pass)."""
    problems = []
    for tests in dict.fromkeys(mutant.tests for mutant in mutants):
        outcome = runner(tests, timeout_s, root)
        if outcome.verdict != "passed":
            print(outcome.tail, file=sys.stderr)
            print(f"baseline {outcome.verdict} ({outcome.first}), once more: {' '.join(tests)}")
            outcome = runner(tests, timeout_s, root)
        print(f"baseline {outcome.verdict:<7} {outcome.seconds:6.1f} s  {' '.join(tests)}")
        if outcome.verdict != "passed":
            print(outcome.tail, file=sys.stderr)
            problems.append(f"{' '.join(tests)}: {outcome.verdict} {outcome.first}")
    return problems


def selected(ids: Optional[Sequence[str]]) -> list[Mutant]:
    """The mutants named by ``--only`` (all without it), every one checked against its file."""
    known = {mutant.id: mutant for mutant in MUTANTS}
    unknown = [i for i in ids or () if i not in known]
    if unknown:
        raise MutationListError(f"unknown mutant ids {unknown}; see --list")
    chosen = [known[i] for i in ids] if ids else list(MUTANTS)
    for mutant in chosen:
        mutated_text(mutant)
    return chosen


def print_list(mutants: Sequence[Mutant]) -> None:
    for mutant in mutants:
        print(f"{mutant.id}  {mutant.path}\n  breaks: {mutant.breaks}")
        print(f"  - {mutant.original.strip()}\n  + {mutant.replacement.strip()}")
        print(f"  tests: {' '.join(mutant.tests)}")


def report(results: Sequence[Result]) -> str:
    """The result table, then the totals."""
    width = max(len(r.mutant.id) for r in results)
    lines = [f"{'id':<{width}}  {'status':<8}  {'time':>7}  killed by"]
    for r in results:
        lines.append(f"{r.mutant.id:<{width}}  {r.status:<8}  {r.seconds:6.1f}s  {r.killed_by}")
    counts = {s: sum(r.status == s for r in results) for s in ("killed", "survived", "error")}
    lines.append(
        f"{counts['killed']} killed, {counts['survived']} survived, {counts['error']} errors "
        f"of {len(results)} mutants in {sum(r.seconds for r in results):.0f} s"
    )
    return "\n".join(lines)


def write_json(path: Path, results: Sequence[Result], baseline: bool) -> None:
    entries = [
        {
            "id": r.mutant.id,
            "path": r.mutant.path,
            "breaks": r.mutant.breaks,
            "tests": list(r.mutant.tests),
            "status": r.status,
            "killed_by": r.killed_by,
            "seconds": round(r.seconds, 1),
        }
        for r in results
    ]
    summary = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": sys.executable,
        "baseline_checked": baseline,
        "mutants": entries,
    }
    path.write_text(json.dumps(summary, indent=2) + "\n")


def exit_status(results: Sequence[Result]) -> int:
    if any(r.status == "error" for r in results):
        return 2
    return 1 if any(r.status == "survived" for r in results) else 0


def raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per pytest run"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of each selection"
    )
    parser.add_argument(
        "--no-confirm", action="store_true", help="skip the unmutated run of each killing test"
    )
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        mutants = selected(args.only)
    except MutationListError as error:
        print(f"mutation_check: {error}", file=sys.stderr)
        return 2
    if args.list:
        print_list(mutants)
        return 0
    signal.signal(signal.SIGTERM, raise_interrupt)
    if not args.no_baseline:
        problems = check_baselines(mutants, args.timeout)
        if problems:
            print("mutation_check: selections fail unmutated:\n  " + "\n  ".join(problems))
            return 2
    results = []
    try:
        for mutant in mutants:
            results.append(run_mutant(mutant, args.timeout, confirm=not args.no_confirm))
            r = results[-1]
            print(f"{r.status:<8} {r.seconds:6.1f} s  {mutant.id}  {r.killed_by}", flush=True)
    except KeyboardInterrupt:
        print("mutation_check: interrupted; the running mutant's file is restored", file=sys.stderr)
        return 130
    print(report(results))
    if args.json:
        write_json(args.json, results, not args.no_baseline)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
