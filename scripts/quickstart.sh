#!/usr/bin/env bash
# Set up the environment if needed, then run the main job. For now that is the scheduler benchmark:
# DCP (default_dynamic_cp) against static CP (dp_balanced) and megatron-core 0.19.2's hybrid-CP
# scheduler on the four reference workloads, plus plan-time scaling (N=1024 skipped: --quick).
# Extra arguments go to `megatron-dcp benchmark`, e.g. `--cost-model model`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m megatron_dcp.cli benchmark --quick "$@"
