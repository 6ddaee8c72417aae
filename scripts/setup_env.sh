#!/usr/bin/env bash
# Idempotent set-up on a fresh CPU machine (Python 3.11): .venv with torch 2.13.0 (CPU),
# megatron-core 0.19.2 (declares Python>=3.12, so installed without its metadata checks) and
# megatron_dcp in editable mode. See ../shared/CPU_BACKEND.md for why each step is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
if ! $VPY -c "import torch, megatron.core, pytest, hypothesis, matplotlib" 2>/dev/null \
    && ! $VPY -c "import torch, pytest, hypothesis, matplotlib; import importlib.metadata as m; assert m.version('megatron-core') == '0.19.2'" 2>/dev/null; then
  $VPY -m pip install -q --upgrade pip
  $VPY -m pip install -q torch==2.13.0
  $VPY -m pip install -q numpy 'packaging>=24.2'
  $VPY -m pip install -q --ignore-requires-python --no-deps megatron-core==0.19.2
  $VPY -m pip install -q pytest pytest-xdist pytest-timeout hypothesis matplotlib psutil typing_extensions
fi
$VPY -m pip install -q --no-deps -e .
