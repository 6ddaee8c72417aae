#!/usr/bin/env bash
# Set up the environment if needed, then run every test: tests/ and functional_tests/ (the latter
# only when it holds test files, since pytest exits 5 on a directory without tests).
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -x -k workloads`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh

dirs=()
for dir in tests functional_tests; do
  if [ -d "$dir" ] && find "$dir" -name 'test_*.py' -o -name '*_test.py' | grep -q .; then
    dirs+=("$dir")
  fi
done
if [ ${#dirs[@]} -eq 0 ]; then
  echo "run_tests: no test files found under tests/ or functional_tests/" >&2
  exit 1
fi
# --durations=15: the slowest fifteen tests close the output, where a slower suite shows first.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "${dirs[@]}" "$@"
