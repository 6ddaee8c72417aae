#!/usr/bin/env bash
# Installs this checkout for GPU training (docs/gpu.md) into a virtual environment on a CUDA
# machine, Python 3.11 or newer: CUDA torch, megatron-core 0.19.2, Transformer Engine (built
# here) and megatron_dcp in editable mode. A second run skips what is already in place (the TE
# build above all, which takes long). Why each step:
#   * torch first, pinned to the version scripts/setup_env.sh uses and to one CUDA wheel
#     (TORCH_CUDA), asked for with its local tag (2.13.0+cu128): a CPU torch of the same version
#     (setup_env's .venv) would otherwise count as installed. Every later pip call gets the same
#     pin as a constraint, so no dependency swaps torch for another build;
#   * megatron-core ≥0.17 declares Requires-Python ≥3.12 although its cp311 wheel works: install
#     it with --ignore-requires-python --no-deps and its runtime needs explicitly (MCORE_DEPS);
#   * Transformer Engine's PyTorch part is compiled against the torch in the venv, so it goes in
#     with --no-build-isolation after its build tools, and only when the CUDA toolkit (nvcc) has
#     the same CUDA major as torch's wheel: a mismatch fails late in the build or at import;
#   * megatron_dcp with --no-deps and its own dependencies explicitly: `pip install -e .` would
#     re-resolve megatron-core and pick 0.16.1 (or fail) on Python 3.11.
# Choosing TORCH_CUDA: `nvcc --version` names the toolkit's CUDA ("release 12.8"); take a wheel
# tag of the same major (cu12x for CUDA 12, cu13x for CUDA 13) that is not newer than the
# "CUDA Version" in the header of `nvidia-smi` (the newest CUDA the driver runs).
# Environment: VENV (default .venv, relative to the repository root), TORCH_CUDA (default cu128),
# PYTHON (interpreter that creates the venv, default python3), CUDA_HOME (the toolkit; else nvcc
# on PATH, else /usr/local/cuda), MAX_JOBS (parallel compile jobs of the TE build; lower it when
# the build runs out of memory).
# Sourcing the script defines its pins and functions without running it
# (tests/unit/test_gpu_install.py).
set -euo pipefail

# --- pins: the only place this script names versions -------------------------------------------
MIN_PYTHON=3.11
TORCH_VERSION=2.13.0  # as scripts/setup_env.sh
TORCH_CUDA=${TORCH_CUDA:-cu128}
TORCH_INDEX=https://download.pytorch.org/whl
MEGATRON_CORE_VERSION=0.19.2  # the version the patch table is written for (setup.py: 0.19.x)
# megatron-core's runtime needs. Declared: torch (above), numpy, packaging>=24.2. Not declared
# but imported on this package's GPU path: einops (megatron-core try-imports it and refuses
# hierarchical CP groups, multi-latent attention and Mamba without it). Left out: its
# training/mlm extras (tokenizer libraries, wandb, ...: add the tokenizer your
# --tokenizer-type needs, e.g. transformers), and pyyaml (only --tp-comm-overlap reads it, which
# DCP refuses).
MCORE_DEPS=(numpy 'packaging>=24.2' einops)
# What TE's PyTorch build imports or runs (--no-build-isolation: none come on their own).
TE_BUILD_DEPS=('setuptools>=61' wheel pybind11 ninja 'cmake>=3.21')
# megatron-core 0.19.2 gates features on TE versions up to 2.14 (docs/gpu.md).
TE_MIN_VERSION=2.14
# setup.py's install_requires less torch and megatron-core, installed above.
DCP_DEPS=(numpy typing_extensions psutil 'tqdm>=4.70.1')

VENV=${VENV:-.venv}
VPY="$VENV/bin/python"
PIN_FILE="$VENV/torch-gpu-pin.txt"

say() { echo "install_gpu: $*"; }
fail() { echo "install_gpu: $*" >&2; exit 1; }

pip_run() {
  "$VPY" -m pip "$@"
}

pip_install() {
  pip_run install --quiet "$@"
}

dist_version() {
  # The installed version of distribution $1, or nothing.
  "$VPY" -I -c 'import importlib.metadata as md, sys
try: print(md.version(sys.argv[1]))
except md.PackageNotFoundError: pass' "$1"
}

tag_cuda_version() {
  # A wheel tag's CUDA version: cu128 -> 12.8, cu130 -> 13.0 (two digits of major, one of minor).
  local digits=${1#cu}
  [[ $1 == cu* && $digits =~ ^[0-9]{3}$ ]] || fail "TORCH_CUDA=$1: expected a tag like cu128"
  echo "${digits:0:2}.${digits:2}"
}

toolkit_cuda_version() {
  # The CUDA version of the toolkit TE is compiled with, from `nvcc --version` ("release 12.8,").
  local nvcc
  if [ -n "${CUDA_HOME:-}" ]; then nvcc="$CUDA_HOME/bin/nvcc"
  else nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); fi
  [ -x "$nvcc" ] || fail "no CUDA toolkit: $nvcc not found (set CUDA_HOME to the toolkit)"
  "$nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p'
}

torch_cuda_version() {
  "$VPY" -c 'import torch; print(torch.version.cuda)'
}

check_cuda_majors() {
  # $1: torch's CUDA (torch.version.cuda), $2: the toolkit's. TE compiled by one CUDA major
  # does not run with torch's libraries of the other; say which TORCH_CUDA fixes it.
  local torch_cuda=$1 toolkit=$2
  if [ -z "$torch_cuda" ] || [ "$torch_cuda" = None ]; then
    fail "torch $TORCH_VERSION in $VENV is a CPU build; run again with a CUDA TORCH_CUDA"
  fi
  [ -n "$toolkit" ] || fail "cannot read the CUDA release from nvcc --version"
  local want=${toolkit%%.*}
  if [ "${torch_cuda%%.*}" != "$want" ]; then
    fail "CUDA mismatch: torch's wheel is CUDA $torch_cuda (TORCH_CUDA=$TORCH_CUDA), the" \
      "toolkit (nvcc) is CUDA $toolkit; run again with a CUDA $want wheel" \
      "(TORCH_CUDA=$(example_tag "$want")) or set CUDA_HOME to a CUDA ${torch_cuda%%.*} toolkit"
  fi
}

example_tag() {
  # A wheel tag of CUDA major $1 for the mismatch message (the default one for CUDA 12).
  case $1 in 12) echo cu128 ;; *) echo "cu${1}0" ;; esac
}

ensure_venv() {
  if [ ! -x "$VPY" ]; then
    say "creating $VENV with $(${PYTHON:-python3} --version)"
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  "$VPY" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$MIN_PYTHON'.split('.'))))" ||
    fail "$VENV has Python $("$VPY" -c 'import platform; print(platform.python_version())')," \
      "this recipe needs $MIN_PYTHON or newer (set PYTHON and remove $VENV)"
}

install_torch() {
  local want="$TORCH_VERSION+$TORCH_CUDA"
  if [ "$(dist_version torch)" != "$want" ]; then
    say "installing torch $want (from the $TORCH_CUDA wheel index)"
    pip_install "torch==$want" --index-url "$TORCH_INDEX/$TORCH_CUDA"
  fi
  echo "torch==$want" > "$PIN_FILE"
}

install_megatron_core() {
  pip_install -c "$PIN_FILE" "${MCORE_DEPS[@]}"
  if [ "$(dist_version megatron-core)" != "$MEGATRON_CORE_VERSION" ]; then
    say "installing megatron-core $MEGATRON_CORE_VERSION"
    pip_install --ignore-requires-python --no-deps "megatron-core==$MEGATRON_CORE_VERSION"
  fi
}

te_ready() {
  # TE's PyTorch part imports and is at least TE_MIN_VERSION: the long build can be skipped.
  "$VPY" -c 'import importlib.metadata as md, sys
import transformer_engine.pytorch
from packaging.version import Version
sys.exit(Version(md.version("transformer_engine")) < Version(sys.argv[1]))' \
    "$TE_MIN_VERSION" >/dev/null 2>&1
}

install_transformer_engine() {
  local torch_cuda toolkit major
  torch_cuda=$(torch_cuda_version)
  toolkit=$(toolkit_cuda_version)
  check_cuda_majors "$torch_cuda" "$toolkit"
  if te_ready; then return 0; fi
  if [ -n "$(dist_version transformer_engine_torch)" ]; then
    say "Transformer Engine does not import (built for another torch?): rebuilding it"
    pip_run uninstall --quiet -y transformer_engine_torch
  fi
  major=${torch_cuda%%.*}
  pip_install -c "$PIN_FILE" "${TE_BUILD_DEPS[@]}"
  say "building Transformer Engine for CUDA $major (compiles CUDA code: often tens of minutes)"
  # Not --quiet: the build is long and its output is the only sign of progress. No cache: a
  # wheel cached from a build against another torch would be reused and would not import.
  pip_run install --no-build-isolation --no-cache-dir -c "$PIN_FILE" \
    "transformer_engine[pytorch,core_cu$major]>=$TE_MIN_VERSION"
}

install_this_package() {
  pip_install --no-deps -e .
  pip_install -c "$PIN_FILE" "${DCP_DEPS[@]}"
}

report() {
  # -I: the source tree's egg-info must not stand in for the installed package.
  "$VPY" -I -c 'import importlib.metadata as md, torch
for name in ("torch", "megatron-core", "transformer_engine", "megatron-dcp"):
    print(f"  {name} {md.version(name)}")
print(f"  CUDA {torch.version.cuda}, GPUs visible: {torch.cuda.device_count()}")'
  say "done. Next: $VENV/bin/megatron-dcp check (docs/gpu.md)"
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  # Fail before the large torch download when the toolkit cannot match the chosen wheel.
  local wheel_cuda toolkit
  wheel_cuda=$(tag_cuda_version "$TORCH_CUDA")
  toolkit=$(toolkit_cuda_version)
  check_cuda_majors "$wheel_cuda" "$toolkit"
  ensure_venv
  install_torch
  install_megatron_core
  install_transformer_engine
  install_this_package
  report
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
