#!/usr/bin/env bash
# The link-rate sweep ("where communication costs"): `megatron-dcp bench-train` (arms
# static, dcp, megatron_dev) on four workloads at 2 ranks (one per core), each over an unshaped
# loopback and over loopbacks shaped by tc's tbf to slower rates; the long-heavy workload repeated
# at two rates; one run on two emulated nodes (4 ranks, oversubscribed). At its start, on the idle
# machine, one rank's fp32 GEMM rate at the model's shapes (python -m megatron_dcp.tools.gemm_rate)
# goes to bench_out/links/machine.json; every run writes bench_out/links/<workload>_<rate>[_tag]/;
# at the end `megatron-dcp link-sweep bench_out/links` prints the table and the communication
# targets and draws bench_out/links/link_sweep.png. Root is needed (network namespaces, tc).
#
# About 30 minutes on this 2-core machine when idle (estimated from idle runs, docs/performance.md;
# at most 40); run it on an otherwise idle machine. Extra arguments go to every bench-train run. Environment (for short runs):
#   PY=python          interpreter (default: .venv/bin/python after scripts/setup_env.sh)
#   WORKLOADS, RATES   subsets, e.g. WORKLOADS="documents long" RATES="unshaped 100mbit"
#   REPEAT_WORKLOADS   workloads run twice more at REPEAT_RATES (default long)
#   REPEAT_RATES       rates of those repeats (default "300mbit 100mbit")
#   NODES_RATE         rate of the two-node run ("" skips it; default 100mbit)
#   BATCHES, WARMUP    global batches per arm, warm-up included (default 8, 2)
#   OUT                output folder (default bench_out/links)
set -euo pipefail -o noglob  # noglob: the distributions' `*` are not file patterns
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then bash scripts/setup_env.sh; PY=.venv/bin/python; fi
OUT=${OUT:-bench_out/links}
WORKLOADS=${WORKLOADS:-documents sft rl long}
RATES=${RATES:-unshaped 1gbit 300mbit 100mbit}
REPEAT_WORKLOADS=${REPEAT_WORKLOADS-long}
REPEAT_RATES=${REPEAT_RATES-300mbit 100mbit}
NODES_RATE=${NODES_RATE-100mbit}
BATCHES=${BATCHES:-8}
WARMUP=${WARMUP:-2}
EXTRA=("$@")

# A GPT whose step is mostly attention (the cost CP sizes change); sequences up to 2,048 tokens and
# a budget of 1,024 per rank, so that static CP must shard every sequence and the longest need it.
MODEL=(--num-layers 2 --hidden-size 128 --ffn-hidden-size 512 --num-attention-heads 4)
LONG2K=(--seq-length 2048 --max-position-embeddings 2048 --max-seqlen-per-dp-cp-rank 1024)
SFT_DIR=bench_out/sft_data
workload_flags() {  # the data flags of one workload at 2 ranks
  case $1 in
    documents) echo "${LONG2K[*]} --global-batch-size 16"
       echo "--varlen-distribution lognormal:median=500,sigma=0.8,min=32,max=2048" ;;
    sft) echo "--sft-data $SFT_DIR/conversations.jsonl --tokenizer-type HuggingFaceTokenizer"
       echo "--tokenizer-model $SFT_DIR/tokenizer --seq-length 1024 --max-position-embeddings 1024"
       echo "--max-seqlen-per-dp-cp-rank 512 --global-batch-size 32" ;;
    rl) echo "${LONG2K[*]} --global-batch-size 8 --varlen-distribution"
       echo "mixture:0.7*lognormal:median=600,sigma=0.6,min=128,max=2048|0.3*constant:value=2048" ;;
    # Long-heavy: half the sequences uniform over (max/2, max], the rest long-tailed documents.
    long) echo "${LONG2K[*]} --global-batch-size 8 --varlen-distribution"
       echo "mixture:0.5*uniform:min=1025,max=2048|0.5*lognormal:median=500,sigma=0.8,min=32,max=2048" ;;
    *) echo "bench_links.sh: unknown workload '$1' (documents, sft, rl, long)" >&2; return 2 ;;
  esac
}

# The unshaped loopback's rate, probed as bench-train --link-rate probes a shaped one (the report
# reads link.json where bench_train.json has no link object).
PROBE='
import json, socket, sys
from megatron_dcp.tools.link.probe import probe_between_processes
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
probed = probe_between_processes("127.0.0.1", port)
json.dump({"requested": "unshaped", "probed_bytes_per_s": probed, "nodes": 1}, open(sys.argv[1], "w"))
print(f"unshaped loopback: {probed / 1e6:.1f} MB/s probed")
'

run() {  # workload, rate, tag ("" or r2, 2nodes, ...), ranks, extra bench-train flags...
  local workload=$1 rate=$2 tag=$3 nproc=$4 name; shift 4
  name=${workload}_${rate}${tag:+_$tag}
  local dir=$OUT/$name start=$SECONDS status=0
  local bench=("$PY" -m megatron_dcp.tools bench-train --nproc "$nproc" --out "$dir"
               --batches "$BATCHES" --warmup "$WARMUP" "${MODEL[@]}" $(workload_flags "$workload")
               "$@" "${EXTRA[@]}")
  mkdir -p "$dir"
  rm -f "$dir/link.json" "$dir/bench_train.json"
  if [ "$rate" = unshaped ]; then
    "$PY" -c "$PROBE" "$dir/link.json"
    "${bench[@]}" > "$dir.txt" 2>&1 || status=$?
  else
    "${bench[@]}" --link-rate "$rate" > "$dir.txt" 2>&1 || status=$?
  fi
  tail -n 12 "$dir.txt"
  [ "$status" = 0 ] || echo "bench_links.sh: $name FAILED (exit $status; see $dir.txt)"
  echo "$name $((SECONDS - start)) s" | tee -a "$OUT/timings.txt"
  progress_line
}

# The sweep's progress after each run: runs done of all, their time, an estimate of what is left
# from the runs' times in timings.txt (`link-sweep --progress`; a failure there stops no sweep).
progress_line() {
  "$PY" -m megatron_dcp.tools link-sweep "$OUT" --progress "$RUNS_TOTAL" || true
}

# How many runs the loops below make (the sweep's progress counts against it).
count_runs() {
  local total=0 workload
  for workload in $WORKLOADS; do total=$((total + $(wc -w <<< "$RATES"))); done
  for workload in $REPEAT_WORKLOADS; do
    case " $WORKLOADS " in *" $workload "*)
      total=$((total + 2 * $(wc -w <<< "$REPEAT_RATES"))) ;;
    esac
  done
  [ -z "$NODES_RATE" ] || total=$((total + 1))
  echo "$total"
}
RUNS_TOTAL=$(count_runs)

mkdir -p "$OUT"
: > "$OUT/timings.txt"
[ -f "$SFT_DIR/conversations.jsonl" ] || "$PY" -m megatron_dcp.tools sft-corpus --out "$SFT_DIR" \
  --conversations 4000
"$PY" -m megatron_dcp.tools.gemm_rate --tokens 1024 --hidden 128 --ffn 512 --out "$OUT/machine.json"
for workload in $WORKLOADS; do
  for rate in $RATES; do
    run "$workload" "$rate" "" 2
  done
done
for workload in $REPEAT_WORKLOADS; do
  case " $WORKLOADS " in *" $workload "*)
    for rate in $REPEAT_RATES; do
      for tag in r2 r3; do run "$workload" "$rate" "$tag" 2; done
    done ;;
  esac
done
if [ -n "$NODES_RATE" ]; then  # budget 512: the longest sequences need CP 4
  run long "$NODES_RATE" 2nodes 4 --oversubscribe --nodes 2 --max-seqlen-per-dp-cp-rank 512
fi
"$PY" -m megatron_dcp.tools link-sweep "$OUT" | tee "$OUT/report.md"
