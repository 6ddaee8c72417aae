#!/usr/bin/env bash
# The link-rate sweep of issue 39 ("where communication costs"): `megatron-dcp bench-train` (arms
# static, dcp, megatron_dev) on four workloads at 2 ranks (one per core), each over an unshaped
# loopback and over loopbacks shaped by tc's tbf to slower rates; the long-heavy workload repeated
# at two rates; one run on two emulated nodes (4 ranks, oversubscribed). At its start, on the idle
# machine, one rank's fp32 GEMM rate at the model's shapes (python -m megatron_dcp.tools.gemm_rate)
# goes to bench_out/links/machine.json; every run writes bench_out/links/<workload>_<rate>[_tag]/;
# at the end `megatron-dcp link-sweep bench_out/links` prints the table and the issue's targets and
# draws bench_out/links/link_sweep.png. Root is needed (network namespaces, tc).
#
# About 30 minutes on this 2-core machine when idle (estimated from idle runs, docs/performance.md;
# at most 40); run it on an otherwise idle machine. Extra arguments go to every bench-train run. Environment (for short runs):
#   PY=python          interpreter (default: .venv/bin/python after scripts/setup_env.sh)
#   WORKLOADS, RATES   subsets, e.g. WORKLOADS="documents long" RATES="unshaped 100mbit"
#   REPEAT_RATES       rates at which the long workload runs twice more (default "300mbit 100mbit")
#   NODES_RATE         rate of the two-node run ("" skips it; default 100mbit)
#   BATCHES, WARMUP    global batches per arm, warm-up included (default 8, 2)
#   LINK_MODE          flag (bench-train --link-rate) or unshare (shaped here by hand; no two-node
#                      run); default: flag when megatron_dcp.tools.link exists
#   OUT                output folder (default bench_out/links)
set -euo pipefail -o noglob  # noglob: the distributions' `*` are not file patterns
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then bash scripts/setup_env.sh; PY=.venv/bin/python; fi
OUT=${OUT:-bench_out/links}
WORKLOADS=${WORKLOADS:-documents sft rl long}
RATES=${RATES:-unshaped 1gbit 300mbit 100mbit}
REPEAT_RATES=${REPEAT_RATES-300mbit 100mbit}
NODES_RATE=${NODES_RATE-100mbit}
BATCHES=${BATCHES:-8}
WARMUP=${WARMUP:-2}
if [ -z "${LINK_MODE:-}" ]; then
  LINK_MODE=unshare
  "$PY" -c "import megatron_dcp.tools.link" 2>/dev/null && LINK_MODE=flag
fi
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

# The link's rate as the ranks see it, written to link.json (the report reads it where
# bench_train.json has no link object): bench-train --link-rate's own probe where it exists (the
# shaped runs' method), else a receiver counting what a sender pushes through 127.0.0.1 for 1.5 s.
PROBE='
import json, re, socket, sys, threading, time
def own_probe():
    server = socket.create_server(("127.0.0.1", 0))
    def send():
        with socket.create_connection(server.getsockname()) as s:
            try:
                while True: s.sendall(bytes(65536))
            except OSError: pass
    threading.Thread(target=send, daemon=True).start()
    conn, _ = server.accept()
    received, start = 0, None
    while True:
        received += len(conn.recv(1 << 20))
        now = time.perf_counter()
        if start is None: start, received = now, 0
        elif now - start > 1.5: break
    conn.close()
    return received / (now - start)
def link_probe():
    from megatron_dcp.tools.link.probe import probe_between_processes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    return probe_between_processes("127.0.0.1", port)
rate, out = sys.argv[1], sys.argv[2]
units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8}
m = re.fullmatch(r"([\d.]+)(gbit|mbit|kbit|bit)", rate)
try:
    probed, source = link_probe(), "megatron_dcp.tools.link.probe"
except ImportError:
    probed, source = own_probe(), "bench_links.sh probe"
json.dump({"requested": rate, "requested_bytes_per_s": float(m.group(1)) * units[m.group(2)]
           if m else None, "probed_bytes_per_s": probed, "nodes": 1, "source": source},
          open(out, "w"))
print(f"link {rate}: {probed / 1e6:.1f} MB/s probed ({source})")
'
in_namespace() {  # rate, command...: the command in a fresh network namespace, lo shaped to rate
  local rate=$1; shift
  unshare -n -- bash -c 'ip link set lo up && tc qdisc add dev lo root tbf rate "$0" burst 256kb \
    latency 50ms && GLOO_SOCKET_IFNAME=lo exec "$@"' "$rate" "$@"
}

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
    "$PY" -c "$PROBE" unshaped "$dir/link.json"
    "${bench[@]}" > "$dir.txt" 2>&1 || status=$?
  elif [ "$LINK_MODE" = flag ]; then
    "${bench[@]}" --link-rate "$rate" > "$dir.txt" 2>&1 || status=$?
  else
    in_namespace "$rate" "$PY" -c "$PROBE" "$rate" "$dir/link.json"
    in_namespace "$rate" "${bench[@]}" > "$dir.txt" 2>&1 || status=$?
  fi
  tail -n 12 "$dir.txt"
  [ "$status" = 0 ] || echo "bench_links.sh: $name FAILED (exit $status; see $dir.txt)"
  echo "$name $((SECONDS - start)) s" | tee -a "$OUT/timings.txt"
}

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
case " $WORKLOADS " in *" long "*)
  for rate in $REPEAT_RATES; do
    for tag in r2 r3; do run long "$rate" "$tag" 2; done
  done ;;
esac
if [ -n "$NODES_RATE" ] && [ "$LINK_MODE" = flag ]; then
  run long "$NODES_RATE" 2nodes 4 --oversubscribe --nodes 2 --max-seqlen-per-dp-cp-rank 512
elif [ -n "$NODES_RATE" ]; then
  echo "bench_links.sh: two-node run left out (LINK_MODE=unshare: bench-train has no --nodes)"
fi
"$PY" -m megatron_dcp.tools link-sweep "$OUT" | tee "$OUT/report.md"
