#!/usr/bin/env bash
# Set up the environment if needed, then run the main job: the scheduler benchmark
# (DCP against static CP and megatron-core 0.19.2's hybrid-CP scheduler).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m megatron_dcp.cli benchmark --quick "$@"
