#!/usr/bin/env bash
# One call on a single-GPU machine with no Transformer Engine and no network (issue 41, item 4),
# at most 8 minutes in all (each step has its own timeout):
#   1. the cost probe (scripts/gpu_cost_probe.py: one GPT layer of the cost model's default shape,
#      bf16, PyTorch's flash attention)                                  <= 240 s
#   2. `megatron-dcp check` at world size 1 on the GPU: its environment report and its one-line
#      refusal with the reason (one rank cannot mix CP sizes; no Transformer Engine), or its
#      verdict where it can run                                          <= 90 s
#   3. the GPU-marked tests one GPU can run (tests/gpu; those needing 2 GPUs or TE skip, -rs
#      says why)                                                         <= 120 s
# then writes OUT/device_check.json (every step: command, exit status, seconds, output tail; the
# probe, the check report) and OUT/profile.json, a ready-made `--dcp-cost-profile` built from the
# probe (scripts/device_results.py).
#
#   bash scripts/device_check.sh [--dry-run] [--out DIR]      (default DIR: device_check_out)
#
# --dry-run (CPU, tested in CI: tests/integration/test_device_check.py): the same steps with the
# probe left out (it needs CUDA; its command is recorded), so the check's refusal, the GPU tests'
# skips and the results file are exercised without a GPU.
#
# Wheels it needs beyond torch (megatron-core is pure Python; this package runs from the working
# tree, cwd = repository root, no install): megatron-core==0.19.2 numpy packaging>=24.2 einops
# pyyaml pytest pluggy iniconfig hypothesis attrs sortedcontainers. On a machine with network:
#   pip download --no-deps --only-binary=:all: --python-version 3.11 \
#       --platform manylinux2014_x86_64 -d wheels megatron-core==0.19.2 numpy 'packaging>=24.2' \
#       einops pyyaml pytest pluggy iniconfig hypothesis attrs sortedcontainers
# (--python-version: the device's Python). Put wheels/ in the repository root: the script installs
# from it (pip --no-index --no-deps) when a package is missing.
# Environment: PYTHON (default python3), WHEELS (default wheels).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
OUT=device_check_out
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT=$2; shift ;;
    *) echo "device_check: unknown argument $1 (use --dry-run, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT/steps"
# This package from the working tree, for the scripts too (python scripts/x.py puts scripts/ first).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

install_missing() {
  local modules="megatron.core numpy einops yaml pytest hypothesis"
  if "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" $modules 2>/dev/null; then
    return 0
  fi
  if [ -d "$WHEELS" ]; then
    "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
  else
    echo "device_check: packages missing and no $WHEELS/ folder (see this script's header)" >&2
  fi
}

# step NAME TIMEOUT_S COMMAND...: run it, keeping its output, exit status and seconds.
step() {
  local name=$1 limit=$2
  shift 2
  echo "device_check: $name: $*"
  printf '%s\n' "$*" > "$OUT/steps/$name.cmd"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/steps/$name.log" 2>&1
  echo $? > "$OUT/steps/$name.rc"
  echo $((SECONDS - start)) > "$OUT/steps/$name.s"
  tail -n 3 "$OUT/steps/$name.log"
}

install_missing
PROBE="$PY scripts/gpu_cost_probe.py --out $OUT/probe.json"
if [ "$DRY" = 1 ]; then
  echo "device_check: dry run: the probe needs CUDA, left out: $PROBE"
  printf '%s\n' "$PROBE" > "$OUT/steps/probe.cmd"
else
  step probe 240 $PROBE
fi
step check 90 "$PY" -m megatron_dcp.tools check --nproc 1 --out "$OUT/check" \
  --json "$OUT/check.json"
step gpu_tests 120 "$PY" -m pytest tests/gpu -rs -q -p no:cacheprovider
"$PY" scripts/device_results.py --out "$OUT" $([ "$DRY" = 1 ] && echo --dry-run)
