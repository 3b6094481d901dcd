#!/usr/bin/env bash
# Machine or code? The head-mask soak's server on two commits side by side, one core each
# (taskset), the same flags and the same soak client (this checkout's loadtest.soak); each
# commit's code from a worktree on PYTHONPATH. Compare the servers' throughput logs, not the
# client's duration_s (a newer client may wait for kv_stats an older server does not record).
#   bash scripts/soak_ab.sh c59785b HEAD [requests]      (docs/results/soak/README.md)
set -u
OLD=$1 NEW=$2 REQ=${3:-150}
REPO=$(cd "$(dirname "$0")/.." && pwd); PY=$REPO/.venv/bin/python; OUT=${OUT:-/tmp/soak_ab}
MODEL=$($PY -m vllm_kvevict.model)
mkdir -p "$OUT"
for c in "$OLD" "$NEW"; do
  [ -d "$OUT/$c" ] || git -C "$REPO" worktree add -f "$OUT/$c" "$c" >/dev/null
done
FLAGS="--served-model-name smollm2 --host 127.0.0.1 --enforce-eager --max-model-len 8192
  --seed 0 --dtype float32 --kv-policy prulong --kv-sparsity 0.7 --max-num-batched-tokens 2048
  --max-num-seqs 16 --kv-cache-memory-bytes $((384 << 20))"
pids=()
for i in 0 1; do
  c=$([ $i = 0 ] && echo "$OLD" || echo "$NEW"); port=$((8101 + i))
  (cd /tmp && PYTHONPATH=$OUT/$c VLLM_CPU_OMP_THREADS_BIND=$i VLLM_KVEVICT_STATS_CAPACITY=5000 \
    exec taskset -c $i "$REPO/.venv/bin/vllm" serve "$MODEL" $FLAGS --port $port \
    > "$OUT/serve-$c.log" 2>&1) &
  pids+=($!)
done
for port in 8101 8102; do
  for _ in $(seq 600); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
done
clients=()
for i in 0 1; do
  c=$([ $i = 0 ] && echo "$OLD" || echo "$NEW")
  (cd "$REPO" && taskset -c $i $PY -m loadtest.soak --base-url http://127.0.0.1:$((8101 + i)) \
    --requests "$REQ" --seed 2 --out "$OUT/soak-$c.json" > "$OUT/soak-$c.txt" 2>&1) &
  clients+=($!)
done
wait "${clients[@]}"
kill "${pids[@]}"
for c in "$OLD" "$NEW"; do
  echo "== $c: vLLM's 10-second throughput log"
  grep "Avg prompt throughput" "$OUT/serve-$c.log" | sed -E 's/.*INFO [0-9-]+ ([0-9:]+).*prompt throughput: ([0-9.]+).*generation throughput: ([0-9.]+).*Running: ([0-9]+).*Waiting: ([0-9]+).*/\1 prompt \2 gen \3 running \4 waiting \5/'
done
