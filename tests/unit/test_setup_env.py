"""scripts/setup_env.sh keeps pip's expected complaint about verl off the screen: verl goes in with
``--no-deps``, so pip's post-install check lists its absent requirements under "ERROR: pip's
dependency resolver ..."; those lines are dropped, every other line of pip is shown, and the
exit status is pip's. The script is sourced (which defines its functions without running it) and
pip is replaced by a stand-in that prints what it is given."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup_env.sh"
HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts."
)
ABSENT = [
    f"verl 0.9.1 requires {name}, which is not installed."
    for name in ("hydra-core", "pybind11", "pylatexenc", "tensorboard", "torchdata", "wandb")
]
CONFLICT = "verl 0.9.1 requires numpy<2.0.0, but you have numpy 2.3.1 which is incompatible."
NOT_FOUND = "ERROR: No matching distribution found for verl==9.9"
FAKE_PIP = """#!/usr/bin/env bash
echo "pip stdout: $*"
printf '%s' "$FAKE_STDERR" >&2
exit "$FAKE_RC"
"""


def pip_install(tmp_path: Path, stderr_lines, rc: int) -> subprocess.CompletedProcess:
    """``pip_install --no-deps verl`` of the script, with a pip that writes ``stderr_lines``
    and exits with ``rc``."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PIP)
    fake.chmod(0o755)
    command = f'source "{SCRIPT}"; VPY="{fake}"; pip_install --no-deps verl'
    return subprocess.run(
        ["bash", "-c", command],
        env={
            "PATH": "/usr/bin:/bin",
            "FAKE_STDERR": "".join(f"{line}\n" for line in stderr_lines),
            "FAKE_RC": str(rc),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_absent_verl_requirements_are_kept_off_the_screen(tmp_path):
    done = pip_install(tmp_path, [HEADER, *ABSENT], 0)
    assert done.returncode == 0
    assert done.stderr == ""
    assert done.stdout == "pip stdout: -m pip install --quiet --no-deps verl\n"


@pytest.mark.parametrize(
    "lines, shown",
    [
        ([HEADER, *ABSENT[:2], CONFLICT, *ABSENT[2:]], [HEADER, CONFLICT]),  # a real conflict
        ([NOT_FOUND], [NOT_FOUND]),
        (["WARNING: something else", HEADER, *ABSENT], ["WARNING: something else"]),
    ],
)
def test_every_other_line_of_pip_is_shown(tmp_path, lines, shown):
    done = pip_install(tmp_path, lines, 0)
    assert done.returncode == 0
    assert done.stderr.splitlines() == shown


@pytest.mark.parametrize("rc", [1, 2])
def test_pips_exit_status_is_kept(tmp_path, rc):
    done = pip_install(tmp_path, [NOT_FOUND], rc)
    assert done.returncode == rc
    assert done.stderr.splitlines() == [NOT_FOUND]


def test_sourcing_the_script_runs_nothing(tmp_path):
    """Sourced, the script neither changes directory nor creates or checks .venv."""
    done = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; pwd; declare -F main pip_install'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(tmp_path), "main", "pip_install"]
    assert not (tmp_path / ".venv").exists()
