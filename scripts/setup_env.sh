#!/usr/bin/env bash
# Idempotent set-up on a fresh CPU machine (Python 3.11): creates .venv in the repository root with
# torch 2.13.0 (CPU wheel), megatron-core 0.19.2 and megatron_dcp in editable mode, plus the test
# tools, the plot extra and the verl extra (verl 0.9.1 for its dynamic-CP tests). A second run only
# checks (≈1 s). Why each step (docs/cpu_backend.md):
#   * torch first and pinned, so nothing later pulls a CUDA build;
#   * megatron-core ≥0.17 declares Requires-Python ≥3.12 although its cp311 wheel works: install it
#     with --ignore-requires-python --no-deps (its runtime deps, numpy and packaging, come first);
#   * megatron_dcp with --no-deps, its other dependencies explicitly: `pip install -e .[test]` would
#     re-resolve megatron-core and pick 0.16.1 (or fail) on Python 3.11;
#   * verl with --no-deps: pip's post-install check then lists verl's absent requirements
#     ("verl 0.9.1 requires hydra-core, which is not installed") under "ERROR: pip's dependency
#     resolver ..."; those lines are expected and kept off the screen, every other line of pip
#     (a real error, a version conflict) is shown, and pip's exit status is kept.
# Environment: PYTHON (interpreter that creates .venv, default python3).
# Sourcing the script defines its functions without running it (tests/unit/test_setup_env.py).
set -euo pipefail

VENV=.venv
VPY="$VENV/bin/python"
TEST_DEPS=(pytest pytest-xdist pytest-timeout hypothesis psutil typing_extensions einops pyyaml)
PLOT_DEPS=(matplotlib)  # the `plot` extra: the quick-start's plan picture, simulate --plot
# The `verl` extra (verl's own dynamic-CP path in the tests): verl with --no-deps (its declared
# requirements pull GPU-only packages), then what importing its Megatron engine needs.
VERL=verl==0.9.1
VERL_DEPS=(tensordict==0.10.0 'pyvers>=0.1,<0.2' orjson importlib_metadata ray omegaconf cloudpickle
           'transformers<5.11' codetiming peft datasets)

environment_ready() {
  # Run from / so that the source tree (and its egg-info) does not shadow the installed package.
  local root="$PWD"
  (cd / && "$root/$VPY" - "$root") <<'PY' 2>/dev/null
import importlib.metadata as md, json, sys
from packaging.version import Version
assert md.version("torch").split("+")[0] == "2.13.0"
assert md.version("megatron-core") == "0.19.2"
assert Version(md.version("packaging")) >= Version("24.2")
assert Version(md.version("tqdm")) >= Version("4.70.1")
for name in ("numpy", "pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "matplotlib",
             "psutil", "typing_extensions", "einops", "pyyaml", "tensordict", "ray", "codetiming",
             "peft", "datasets"):
    md.version(name)
assert md.version("verl") == "0.9.1"
url = json.loads(md.distribution("megatron-dcp").read_text("direct_url.json"))
assert url["dir_info"].get("editable") and url["url"] == "file://" + sys.argv[1]
scripts = {ep.name: ep.value for ep in md.entry_points(group="console_scripts")}
assert scripts.get("megatron-dcp") == "megatron_dcp.tools.cli.main:main"  # re-install after moves
PY
}

drop_absent_verl_requirements() {
  # stdin -> stdout without pip's lines about verl requirements that --no-deps left out, and
  # without the resolver's header when nothing else follows it.
  awk -v header="ERROR: pip's dependency resolver does not currently take into account" '
    index($0, header) == 1 { held = $0; next }
    /^verl [^ ]+ requires [^ ]+, which is not installed\.$/ { next }
    { if (held != "") { print held; held = "" } print; fflush() }
  '
}

pip_install() {
  # pip's stderr through the filter, its stdout untouched; the status is pip's (pipefail).
  { "$VPY" -m pip install --quiet "$@" 2>&1 1>&3 3>&- | drop_absent_verl_requirements >&2; } 3>&1
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  if [ ! -x "$VPY" ]; then
    echo "setup_env: creating $VENV with $(${PYTHON:-python3} --version)"
    "${PYTHON:-python3}" -m venv "$VENV"
  fi

  if environment_ready; then
    echo "setup_env: $VENV is ready"
    exit 0
  fi

  echo "setup_env: installing into $VENV (torch, megatron-core, test tools, megatron_dcp)"
  pip_install torch==2.13.0
  pip_install numpy 'packaging>=24.2' 'tqdm>=4.70.1'  # tqdm: megatron_dcp's progress lines
  pip_install --ignore-requires-python --no-deps megatron-core==0.19.2
  pip_install "${TEST_DEPS[@]}" "${PLOT_DEPS[@]}"
  pip_install --no-deps "$VERL"
  echo "torch==2.13.0" > "$VENV/torch-pin.txt"  # no verl dependency may replace the CPU torch
  pip_install -c "$VENV/torch-pin.txt" "${VERL_DEPS[@]}"
  pip_install --no-deps -e .
  environment_ready || { echo "setup_env: the environment check still fails" >&2; exit 1; }
  echo "setup_env: $VENV is ready"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
