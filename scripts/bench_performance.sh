#!/usr/bin/env bash
# The measurements of docs/performance.md: `megatron-dcp bench-train` on three length
# distributions (long-tailed documents, generated SFT conversations, RL-rollout-like lengths) at
# 2 ranks (one per core here) and 4 ranks (oversubscribed on 2 cores, declared so), and once from
# a cost-model prior that is wrong several-fold (the H100 profile on CPU). Each run writes its
# table, JSON and picture under bench_out/<name>/. About 20 minutes on 2 cores; run it on an
# otherwise idle machine (other work on the cores times itself into the figures).
# Extra arguments go to every bench-train run, e.g. `--batches 8`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
BT=(.venv/bin/megatron-dcp bench-train)
MODEL=(--num-layers 2 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4)
DOCS=(--varlen-distribution 'lognormal:median=500,sigma=0.8,min=32,max=4096'
      --seq-length 4096 --max-position-embeddings 4096 --global-batch-size 32)
RL=(--varlen-distribution 'mixture:0.7*lognormal:median=1200,sigma=0.6,min=256,max=4096|0.3*constant:value=4096'
    --seq-length 4096 --max-position-embeddings 4096 --global-batch-size 8)
SFT_DIR=bench_out/sft_data
[ -f "$SFT_DIR/conversations.jsonl" ] || .venv/bin/megatron-dcp sft-corpus --out "$SFT_DIR" --conversations 4000
SFT=(--sft-data "$SFT_DIR/conversations.jsonl" --tokenizer-type HuggingFaceTokenizer
     --tokenizer-model "$SFT_DIR/tokenizer" --seq-length 1024 --max-position-embeddings 1024
     --global-batch-size 64)

run() {  # name, ranks, budget, data flags...
  local name=$1 ranks=$2 budget=$3
  shift 3
  local over=()
  [ "$ranks" -gt "$(nproc)" ] && over=(--oversubscribe)
  "${BT[@]}" --nproc "$ranks" "${over[@]}" --out "bench_out/$name" "${MODEL[@]}" \
    --max-seqlen-per-dp-cp-rank "$budget" "$@" "${EXTRA[@]}" | tee "bench_out/$name.txt"
}

EXTRA=("$@")
mkdir -p bench_out
run documents_2 2 2048 "${DOCS[@]}"
run sft_2 2 512 "${SFT[@]}"
run rl_2 2 2048 "${RL[@]}"
run documents_4 4 1024 "${DOCS[@]}"
run sft_4 4 256 "${SFT[@]}"
run rl_4 4 1024 "${RL[@]}"
run documents_2_h100_prior 2 2048 "${DOCS[@]}" --dcp-hardware-profile h100-nvlink --batches 16
