#!/usr/bin/env bash
# W4 (pagedserve bench serve) through Ray Serve with 1 engine replica, then 2; prints 2-vs-1 ratios.
# Usage: examples/ray_w4.sh [NUM_REQUESTS] [extra serve-ray flags...]
#   e.g. examples/ray_w4.sh 64 --default-model tiny --num-cpus 2 --replica-cpus 0.5
# Results: bench-results/ray-1/ and bench-results/ray-2/ (w4.json, latency CDF).
set -euo pipefail
N=${1:-64}; shift || true
PORT=${PORT:-8100}
PY=${PYTHON:-python}
for replicas in 1 2; do
  "$PY" -m pagedserve serve-ray --num-replicas "$replicas" --port "$PORT" "$@" &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "serve-ray exited before it was ready" >&2; exit 1; }
    sleep 2
  done
  "$PY" -m pagedserve bench serve --url "http://127.0.0.1:$PORT" --rates inf --num-requests "$N" --no-progress \
      --out "bench-results/ray-$replicas"
  kill -INT "$pid"; wait "$pid" || true
done
"$PY" - <<'PY'
import json
one, two = (json.load(open(f"bench-results/ray-{n}/w4.json"))["results"][0] for n in (1, 2))
for k in ("request_throughput", "output_tokens_per_s"):
    print(f"{k}: 1 replica {one[k]:.2f}, 2 replicas {two[k]:.2f}, ratio {two[k] / one[k]:.2f}x")
PY
