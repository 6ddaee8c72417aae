#!/usr/bin/env bash
# Set up the environment if needed, then run every test: tests/ and functional_tests/.
# First the collection is counted per layer (unit, distributed, integration, functional, gpu) and
# held to the floors in tests/collection_floors.json (scripts/count_tests.py): a layer that
# collects fewer tests, a collection error or a lost directory fails the run before any test runs.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -x -k workloads`; the count is of
# the whole collection whatever they select.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh

.venv/bin/python scripts/count_tests.py tests functional_tests
# --durations=15: the slowest fifteen tests close the output, where a slower suite shows first.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests functional_tests "$@"
