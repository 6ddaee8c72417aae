#!/usr/bin/env bash
# One call on a single-GPU machine with no Transformer Engine and no network,
# at most 9 minutes in all (each step has its own timeout):
#   0. packages: the wheels below installed when one is missing                  <= 60 s
#   1. probe: the cost probe (scripts/gpu_cost_probe.py: one GPT layer of the cost model's default
#      shape, bf16, PyTorch's flash attention)                                    <= 240 s
#   2. check: `megatron-dcp check` at world size 1 on the GPU: its environment report and its
#      one-line refusal with the reason (one rank cannot mix CP sizes; no Transformer Engine),
#      or its verdict where it can run                                            <= 90 s
#   3. gpu_tests: the GPU-marked tests one GPU can run (tests/gpu; those needing 2 GPUs or TE
#      skip, -rs says why; the outcomes in OUT/gpu_tests.xml, JUnit XML)          <= 120 s
# then scripts/device_results.py writes OUT/device_check.json (every step: command, exit status,
# seconds, output tail, outcome; the probe, the check report, the GPU tests' counts) and
# OUT/profile.json, a ready-made `--dcp-cost-profile` built from the probe, and judges the steps.
#
# Exit status 0 only when every step passed: the probe left a valid probe.json, check PASSed and
# at least one GPU test passed with none failing. A step that failed, timed out or was not run,
# a check that refused (nothing compared), every GPU test skipped (nothing compared): exit 1.
# The last line says which: `device_check: PASS (packages ok, probe ok, check PASS, gpu tests
# N passed M skipped)` or `device_check: FAIL: <step>: <why> | <step>: <why>`, every failed step.
# On one GPU check refuses (one rank cannot mix CP sizes), so there the run ends in FAIL naming
# check: nothing compared DCP with static CP.
#
#   bash scripts/device_check.sh [--dry-run] [--stubs DIR] [--out DIR]  (default: device_check_out)
#
# --dry-run (CPU, tested in CI: tests/integration/test_device_check.py): the same steps with the
# probe left out (it needs CUDA; its command is recorded), so the check's refusal, the GPU tests'
# skips and the results file are exercised without a GPU; it ends in FAIL, naming them.
# --stubs DIR (tests only): a step NAME (packages, probe, check, gpu_tests, results) with a file
# DIR/NAME runs that file instead, given the real command as its arguments; the others run as usual.
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
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
MODULES="megatron.core numpy einops yaml pytest hypothesis"
OUT=device_check_out
DRY=0
STUBS=
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --stubs) STUBS=${2:?--stubs needs a folder}; shift ;;
    *) echo "device_check: unknown argument $1 (--dry-run, --stubs DIR, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
# An earlier run's files in OUT would be judged as this run's.
rm -rf "$OUT/steps"
rm -f "$OUT"/{probe,check,profile,device_check}.json "$OUT/gpu_tests.xml"
mkdir -p "$OUT/steps"
# This package from the working tree, for the scripts too (python scripts/x.py puts scripts/ first).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The packages this needs beyond torch; from WHEELS when one is missing (the header).
install_missing() {
  local all_found="import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))"
  if "$PY" -c "$all_found" $MODULES 2>/dev/null; then
    echo "every package present: $MODULES"
  elif [ -d "$WHEELS" ]; then
    "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
  else
    echo "a package is missing ($MODULES) and there is no $WHEELS/ folder (this script's header)"
    return 1
  fi
}
export -f install_missing
export PY WHEELS MODULES

# stubbed NAME COMMAND...: sets COMMAND to what step NAME runs: COMMAND, or under --stubs DIR
# with a file DIR/NAME, that file with COMMAND as its arguments.
stubbed() {
  local name=$1
  shift
  COMMAND=("$@")
  if [ -n "$STUBS" ] && [ -e "$STUBS/$name" ]; then
    COMMAND=("$STUBS/$name" "$@")
  fi
}

# step NAME TIMEOUT_S COMMAND...: run it, keeping its command, output, exit status and seconds.
step() {
  local name=$1 limit=$2 rc=0 start=$SECONDS
  shift 2
  stubbed "$name" "$@"
  echo "device_check: $name: ${COMMAND[*]}"
  printf '%s\n' "${COMMAND[*]}" > "$OUT/steps/$name.cmd"
  timeout --kill-after=10 "$limit" "${COMMAND[@]}" > "$OUT/steps/$name.log" 2>&1 || rc=$?
  echo "$rc" > "$OUT/steps/$name.rc"
  echo $((SECONDS - start)) > "$OUT/steps/$name.s"
  tail -n 3 "$OUT/steps/$name.log"
}

# The steps that exited non-zero, for a verdict scripts/device_results.py could not give.
nonzero_steps() {
  local file names=""
  for file in "$OUT"/steps/*.rc; do
    [ -e "$file" ] && [ "$(<"$file")" != 0 ] && names+=" $(basename "$file" .rc)"
  done
  echo "${names:- none}"
}

# results [--dry-run]: scripts/device_results.py's files and verdict, whose line ends the run;
# a verdict it could not give (or one at odds with its exit status) is a failure too.
results() {
  local rc=0 output last
  stubbed results "$PY" scripts/device_results.py --out "$OUT" "$@"
  output=$("${COMMAND[@]}" 2>&1) || rc=$?
  printf '%s\n' "$output"
  last=${output##*$'\n'}
  case "$rc:$last" in
    "0:device_check: PASS"*) return 0 ;;
    "1:device_check: FAIL"*) return 1 ;;
  esac
  echo "device_check: FAIL: results: ${COMMAND[*]} exited $rc without a verdict ($last);" \
    "steps that exited non-zero:$(nonzero_steps)"
  return 1
}

step packages 60 bash -c install_missing
PROBE=("$PY" scripts/gpu_cost_probe.py --out "$OUT/probe.json")
if [ "$DRY" = 1 ]; then
  echo "device_check: dry run: the probe needs CUDA, left out: ${PROBE[*]}"
  printf '%s\n' "${PROBE[*]}" > "$OUT/steps/probe.cmd"
else
  step probe 240 "${PROBE[@]}"
fi
step check 90 "$PY" -m megatron_dcp.tools check --nproc 1 --out "$OUT/check" \
  --json "$OUT/check.json"
step gpu_tests 120 "$PY" -m pytest tests/gpu -rs -q -p no:cacheprovider \
  --junitxml "$OUT/gpu_tests.xml"
if [ "$DRY" = 1 ]; then results --dry-run; else results; fi
