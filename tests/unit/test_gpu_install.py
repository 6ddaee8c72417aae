"""scripts/install_gpu.sh, the one GPU install recipe (docs/gpu.md), without a GPU.

Its pins are read by sourcing the script (which defines them without running it) and compared
with scripts/setup_env.sh and setup.py. Its ``main`` runs with pip, the venv and the torch
queries replaced by stand-ins and a fake ``nvcc`` (``CUDA_HOME``), so the test sees every pip
command it would give: megatron-core with ``--ignore-requires-python --no-deps``, Transformer
Engine with ``--no-build-isolation`` only after the CUDA-major check, this checkout with
``--no-deps``. Last, no tracked file tells users to install through a package that is not
published, and the places that say how to install point to the script.
"""

import ast
import importlib.metadata as md
import re
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_gpu.sh"
SETUP_ENV = REPO / "scripts" / "setup_env.sh"
RECIPE = "scripts/install_gpu.sh"
# Stand-ins for the functions that touch the venv or pip: every pip command is printed.
DRY_RUN = """
ensure_venv() { :; }
report() { :; }
te_ready() { return 1; }
dist_version() { :; }
torch_cuda_version() { echo "$FAKE_TORCH_CUDA"; }
pip_run() { echo "pip $*"; }
"""
NVCC = """#!/bin/sh
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release $FAKE_NVCC, V$FAKE_NVCC.1"
"""


def bash(command: str, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None):
    """``command`` in bash after sourcing the script, with a bare environment plus ``env``."""
    return subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; {command}'],
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def pin(name: str) -> str:
    done = bash(f'echo "${name}"')
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def pin_list(name: str) -> List[str]:
    done = bash(f'printf "%s\\n" "${{{name}[@]}}"')
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def setup_env_pins(package: str) -> set:
    """Every version scripts/setup_env.sh pins ``package`` to (``package==X``)."""
    return set(re.findall(rf"\b{re.escape(package)}==([0-9][\w.]*)", SETUP_ENV.read_text()))


def install_requires() -> List[Requirement]:
    """setup.py's ``install_requires``, read without running setup.py."""
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [Requirement(item) for item in ast.literal_eval(node.value)]
    raise AssertionError("setup.py has no install_requires")


def fake_nvcc(tmp_path: Path) -> Path:
    """A CUDA_HOME whose bin/nvcc reports release $FAKE_NVCC."""
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(NVCC)
    nvcc.chmod(0o755)
    return nvcc.parent.parent


def dry_run(tmp_path: Path, torch_cuda: str, nvcc: str, tag: str = "cu128"):
    """The script's main with the stand-ins: (completed process, its pip commands)."""
    env = {
        "VENV": str(tmp_path / "venv"),
        "TORCH_CUDA": tag,
        "CUDA_HOME": str(fake_nvcc(tmp_path)),
        "FAKE_TORCH_CUDA": torch_cuda,
        "FAKE_NVCC": nvcc,
    }
    (tmp_path / "venv").mkdir()
    done = bash(f"{DRY_RUN}\nmain", env)
    return done, [line[4:] for line in done.stdout.splitlines() if line.startswith("pip ")]


# --- pins --------------------------------------------------------------------------------------


def test_torch_pin_is_setup_envs():
    assert setup_env_pins("torch") == {pin("TORCH_VERSION")}


def test_megatron_core_pin_is_setup_envs_and_fits_setup_py():
    version = pin("MEGATRON_CORE_VERSION")
    assert setup_env_pins("megatron-core") == {version}
    (declared,) = [req for req in install_requires() if req.name == "megatron-core"]
    assert declared.specifier.contains(version), f"setup.py wants {declared}"


def test_this_packages_own_dependencies_are_installed():
    """setup.py's install_requires, less torch and megatron-core (installed by their own
    steps), are DCP_DEPS exactly, with the same bounds."""
    wanted = {str(req) for req in install_requires() if req.name not in ("torch", "megatron-core")}
    assert {str(Requirement(text)) for text in pin_list("DCP_DEPS")} == wanted


def test_megatron_cores_declared_requirements_are_installed():
    """--no-deps skips what megatron-core declares: MCORE_DEPS lists each (torch has its step)."""
    try:
        declared = [Requirement(text) for text in md.requires("megatron-core") or []]
    except md.PackageNotFoundError:
        pytest.skip("megatron-core is not installed here")
    runtime = {str(req) for req in declared if req.marker is None and req.name != "torch"}
    assert runtime <= set(pin_list("MCORE_DEPS"))


# --- the pip commands of main ------------------------------------------------------------------


def test_the_pip_commands_in_order(tmp_path):
    done, pips = dry_run(tmp_path, torch_cuda="12.8", nvcc="12.8")
    assert done.returncode == 0, done.stderr
    torch_pin = f"torch=={pin('TORCH_VERSION')}+cu128"
    index = "https://download.pytorch.org/whl/cu128"
    assert pips[0] == f"install --quiet {torch_pin} --index-url {index}"
    assert (tmp_path / "venv" / "torch-gpu-pin.txt").read_text() == f"{torch_pin}\n"
    mcore = index_of(pips, f"megatron-core=={pin('MEGATRON_CORE_VERSION')}")
    assert {"--ignore-requires-python", "--no-deps"} <= set(pips[mcore].split())
    build, te = index_of(pips, "pybind11"), index_of(pips, "transformer_engine[")
    assert build < te and "ninja" in pips[build].split()
    assert "--no-build-isolation" in pips[te].split()
    assert f"transformer_engine[pytorch,core_cu12]>={pin('TE_MIN_VERSION')}" in pips[te].split()
    this = index_of(pips, "-e .")
    assert "--no-deps" in pips[this].split() and this > te


def test_no_later_pip_command_may_replace_torch(tmp_path):
    """After torch, every pip command resolves nothing (--no-deps) or under the torch pin."""
    pin_file = str(tmp_path / "venv" / "torch-gpu-pin.txt")
    _, pips = dry_run(tmp_path, torch_cuda="12.8", nvcc="12.8")
    for command in pips[1:]:
        words = command.split()
        assert "--no-deps" in words or ("-c" in words and pin_file in words), command


def index_of(pips: List[str], text: str) -> int:
    (index,) = [i for i, command in enumerate(pips) if text in command]
    return index


# --- the CUDA-major check ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "torch_cuda, toolkit", [("12.8", "12.8"), ("12.8", "12.4"), ("13.0", "13.1")]
)
def test_the_cuda_check_accepts_one_major(torch_cuda, toolkit):
    done = bash(f"check_cuda_majors {torch_cuda} {toolkit}")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize(
    "torch_cuda, toolkit, fix", [("12.8", "13.0", "cu130"), ("13.0", "12.6", "cu128")]
)
def test_the_cuda_check_refuses_another_major(torch_cuda, toolkit, fix):
    done = bash(f"check_cuda_majors {torch_cuda} {toolkit}")
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert f"CUDA {torch_cuda}" in line and f"CUDA {toolkit}" in line
    assert f"TORCH_CUDA={fix}" in line


def test_a_cpu_torch_is_refused():
    done = bash("check_cuda_majors None 12.8")
    assert done.returncode == 1 and "CPU build" in done.stderr


def test_a_mismatch_stops_before_any_install(tmp_path):
    """The wheel tag (cu128: CUDA 12) against a CUDA 13 toolkit fails before the torch download."""
    done, pips = dry_run(tmp_path, torch_cuda="12.8", nvcc="13.0", tag="cu128")
    assert done.returncode == 1 and pips == []
    assert "CUDA 12.8" in done.stderr and "CUDA 13.0" in done.stderr


def test_transformer_engine_is_not_built_against_another_major(tmp_path):
    """torch reports another CUDA than its tag promised: the check before TE's build stops it."""
    done, pips = dry_run(tmp_path, torch_cuda="13.0", nvcc="12.8", tag="cu128")
    assert done.returncode == 1 and pips and not any("transformer_engine[" in p for p in pips)


@pytest.mark.parametrize("tag, version", [("cu128", "12.8"), ("cu130", "13.0"), ("cu126", "12.6")])
def test_wheel_tags_name_their_cuda(tag, version):
    assert bash(f"tag_cuda_version {tag}").stdout == f"{version}\n"


@pytest.mark.parametrize("tag", ["cpu", "cu12", "12.8", "cu1280"])
def test_a_tag_that_is_no_cuda_wheel_is_refused(tag):
    done = bash(f"tag_cuda_version {tag}")
    assert done.returncode == 1 and "expected a tag like cu128" in done.stderr


def test_the_toolkit_version_is_read_from_nvcc(tmp_path):
    env = {"CUDA_HOME": str(fake_nvcc(tmp_path)), "FAKE_NVCC": "12.9"}
    assert bash("toolkit_cuda_version", env).stdout == "12.9\n"
    missing = bash("toolkit_cuda_version", {"CUDA_HOME": str(tmp_path / "none")})
    assert missing.returncode == 1 and "no CUDA toolkit" in missing.stderr


def test_sourcing_the_script_runs_nothing(tmp_path):
    done = bash("pwd; declare -F main check_cuda_majors", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(tmp_path), "main", "check_cuda_majors"]
    assert list(tmp_path.iterdir()) == []


# --- what the repository tells users -----------------------------------------------------------

# Install commands through names that resolve to nothing published: this package's name with an
# extra (it is not on any index), and the checkout's te extra (it re-resolves megatron-core on
# Python 3.11).
UNPUBLISHED = ("megatron-dcp[", ".[te]")


def tracked_text_files() -> List[Path]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    paths = [REPO / name for name in names if REPO / name != Path(__file__).resolve()]
    return [path for path in paths if path.is_file() and b"\0" not in path.read_bytes()[:4096]]


def test_no_file_installs_through_an_unpublished_name():
    offenders = [
        f"{path.relative_to(REPO)}: {text}"
        for path in tracked_text_files()
        for text in UNPUBLISHED
        if text in path.read_text(encoding="utf-8", errors="replace")
    ]
    assert offenders == []


def install_section(doc: str) -> str:
    text = (REPO / doc).read_text()
    return text.split("## Install", 1)[1].split("\n## ", 1)[0]


def test_gpu_md_installs_with_the_recipe():
    (block,) = re.findall(r"```bash\n(.*?)```", install_section("docs/gpu.md"), re.S)
    assert block.strip() == f"bash {RECIPE}"


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md", "docs/troubleshooting.md"])
def test_the_docs_point_to_the_recipe(doc):
    assert RECIPE in (REPO / doc).read_text()


def test_the_checks_refusal_points_to_the_recipe():
    source = (REPO / "megatron_dcp" / "tools" / "cli" / "check.py").read_text()
    (refusal,) = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "refusal"
    ]
    texts = [n.value for n in ast.walk(refusal) if isinstance(n, ast.Constant)]
    (message,) = [t for t in texts if isinstance(t, str) and t.startswith("no Transformer Engine")]
    assert RECIPE in message
