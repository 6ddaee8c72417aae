#!/usr/bin/env bash
# Set up the environment if needed, then run every test (unit, distributed, functional).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
dirs=(tests)
if find functional_tests -name 'test_*.py' 2>/dev/null | grep -q .; then dirs+=(functional_tests); fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${dirs[@]}" "$@"
