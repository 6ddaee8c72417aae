#!/usr/bin/env bash
# Set up the environment if needed, then run the main job: a tiny GPT trained on 8 CPU ranks
# (TP2 × CP4) with static CP and with DCP on the same variable-length data, compared side by side
# (losses, micro-batches, CP sizes, load imbalance, tokens/s) with the plan picture of iteration 1
# written to quickstart_out/. About two minutes on 2 cores after set-up.
# Extra arguments go to `python -m megatron_dcp.tools.quickstart`, e.g. `--iters 10`, or `--sft`
# to train on generated conversations with the loss on the assistant's tokens only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m megatron_dcp.tools.quickstart "$@"
