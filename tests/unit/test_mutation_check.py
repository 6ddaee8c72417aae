"""The mutation check's list stays valid as the code changes, and the check always restores the
file it mutated (``scripts/mutation_check.py``; tests/README.md, "Mutation check"). Pure Python:
the script imports neither torch nor megatron; no pytest is run here."""

import hashlib
from collections import Counter
from pathlib import Path

import pytest
from script_loader import load_script

REPO = Path(__file__).resolve().parents[2]
check = load_script("mutation_check")
MUTANTS = check.MUTANTS


def test_the_list_is_large_and_its_ids_unique():
    assert len(MUTANTS) >= 25
    assert [i for i, n in Counter(m.id for m in MUTANTS).items() if n > 1] == []


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_every_mutant_matches_its_file_once_and_changes_it(mutant):
    original, mutated = check.mutated_text(mutant)  # refuses 0 or 2+ matches and syntax breaks
    assert mutated != original
    assert original.decode().count(mutant.original) == 1


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_every_mutant_names_tests_that_exist(mutant):
    assert mutant.tests
    for test in mutant.tests:
        path, _, name = test.partition("::")
        assert (REPO / path).is_file(), test
        function = name.split("[")[0]
        assert not function or f"def {function}(" in (REPO / path).read_text(), test


def planted(tmp_path, text="a = 1\nb = a + 1\n", original="a + 1", replacement="a - 1"):
    """A mutant of a file of our own under ``tmp_path``."""
    (tmp_path / "target.py").write_text(text)
    return check.Mutant("planted", "target.py", original, replacement, ("tests/x.py",), "-")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "text, original, replacement, message",
    [
        ("a = 1\n", "a + 1", "a - 1", "occurs 0 times"),
        ("a + 1\na + 1\n", "a + 1", "a - 1", "occurs 2 times"),
        ("a + 1\n", "a + 1", "a + 1", "changes nothing"),
        ("a + 1\n", "a + 1", "a +", "syntax break"),
    ],
)
def test_a_mutant_that_does_not_fit_is_refused(tmp_path, text, original, replacement, message):
    mutant = planted(tmp_path, text, original, replacement)
    with pytest.raises(check.MutationListError, match=message):
        check.mutated_text(mutant, tmp_path)


def recording_runner(path: Path, seen: list, outcome=None, error=None):
    """A stand-in for pytest: records the file's text while "running", then answers or raises."""

    def run(tests, timeout_s, root):
        seen.append(path.read_text())
        if error is not None:
            raise error
        return outcome

    return run


@pytest.mark.parametrize(
    "outcome, status, killed_by",
    [
        (check.Outcome("failed", "tests/x.py::test_y", 1.0), "killed", "tests/x.py::test_y"),
        (check.Outcome("passed", "", 1.0), "survived", ""),
        (check.Outcome("timeout", "timeout after 5 s", 5.0), "killed", "timeout after 5 s"),
    ],
)
def test_the_file_is_mutated_during_the_run_and_restored_after(
    tmp_path, outcome, status, killed_by
):
    mutant = planted(tmp_path)
    path, seen = tmp_path / "target.py", []
    before, mtime = digest(path), path.stat().st_mtime_ns
    runner = recording_runner(path, seen, outcome)
    result = check.run_mutant(mutant, 5, tmp_path, runner, confirm=False)
    assert seen == ["a = 1\nb = a - 1\n"]
    assert (result.status, result.killed_by) == (status, killed_by)
    assert digest(path) == before and path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("runner crashed")])
def test_the_file_is_restored_on_ctrl_c_and_errors(tmp_path, error):
    mutant = planted(tmp_path)
    path, seen = tmp_path / "target.py", []
    before = digest(path)
    with pytest.raises(type(error)):
        check.run_mutant(mutant, 5, tmp_path, recording_runner(path, seen, error=error))
    assert seen == ["a = 1\nb = a - 1\n"] and digest(path) == before


def test_a_kill_counts_only_when_the_killing_test_passes_unmutated(tmp_path):
    """The killing test runs once more on the original code: passing there confirms the kill;
    failing there too (flaky, or broken anyway) makes the mutant an error after a second try."""
    mutant = planted(tmp_path)
    path = tmp_path / "target.py"
    failed = check.Outcome("failed", "tests/x.py::test_y", 1.0)
    for unmutated, status in (("passed", "killed"), ("failed", "error")):
        texts = []

        def run(tests, timeout_s, root):
            texts.append(path.read_text())
            mutated = "a - 1" in texts[-1]
            return failed if mutated else check.Outcome(unmutated, "tests/x.py::test_y", 1.0)

        result = check.run_mutant(mutant, 5, tmp_path, run)
        assert result.status == status
        runs = 1 if status == "killed" else 2  # an unconfirmed kill is tried once more
        assert ["a - 1" in t for t in texts] == [True, False] * runs


@pytest.mark.parametrize(
    "returncode, output, verdict, first",
    [
        (0, "3 passed", "passed", ""),
        (1, "FAILED tests/a.py::test_b[x-y] - Assertion\n", "failed", "tests/a.py::test_b[x-y]"),
        (2, "ERROR tests/a.py - ImportError\n", "failed", "tests/a.py"),
        (4, "ERROR: file or directory not found", "broken", "pytest exit status 4"),
        (5, "no tests ran", "broken", "pytest exit status 5"),
        (-6, "", "failed", "crash (signal 6)"),
    ],
)
def test_pytest_outcomes(returncode, output, verdict, first):
    outcome = check.outcome_of(returncode, output, 1.0)
    assert (outcome.verdict, outcome.first) == (verdict, first)


def test_exit_status_is_non_zero_when_a_mutant_survives(tmp_path):
    mutant = planted(tmp_path)
    result = {s: check.Result(mutant, s, "", 1.0) for s in ("killed", "survived", "error")}
    assert check.exit_status([result["killed"]]) == 0
    assert check.exit_status([result["killed"], result["survived"]]) == 1
    assert check.exit_status([result["survived"], result["error"]]) == 2
