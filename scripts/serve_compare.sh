#!/usr/bin/env bash
# `vllm serve` and `pagedserve serve`, one after the other, on the same model, each driven by vLLM's
# own `bench serve` client (random dataset, 288 tokens in / 144 out +-25 %, 64 prompts,
# --ignore-eos), at each rate given. vLLM comes from `scripts/setup_peers.sh vllm`; it is never a
# project dependency. Run from the repository root:
#
#   scripts/serve_compare.sh MODEL_DIR [RATES]      RATES default "inf 4"
#
# DTYPE (default bfloat16; float32 on CPUs without native bf16) is both servers' --dtype. Logs and
# the client's JSON results go to $PAGEDSERVE_CACHE/peers/logs/serve_compare_<time>/.
set -uo pipefail
MODEL=$(realpath "${1:?usage: scripts/serve_compare.sh MODEL_DIR [RATES]}")
RATES=${2:-"inf 4"}
DTYPE=${DTYPE:-bfloat16}
CACHE="${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}"
PEERS="${PEERS:-$CACHE/peers}"
V="$PEERS/venv-vllm"
PS="${PYTHON:-.venv/bin/python}"
[ -x "$V/bin/python" ] || { echo "no vLLM venv at $V: run scripts/setup_peers.sh vllm" >&2; exit 1; }
OUT="$PEERS/logs/serve_compare_$(date +%H%M%S)"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1

up() {  # wait for a server's /v1/models, at most 300 s
  for _ in $(seq 300); do curl -sf "127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done
  echo "server on port $1 did not start: see $OUT" >&2; return 1
}

client() {  # name port: vLLM's bench serve at every rate (its `vllm` script refuses to start on CPU)
  for rate in $RATES; do
    "$V/bin/python" -c 'import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))' \
      --backend openai --base-url "http://127.0.0.1:$2" --endpoint /v1/completions --model m \
      --tokenizer "$MODEL" --dataset-name random --random-input-len 288 --random-output-len 144 \
      --random-range-ratio 0.75 --num-prompts 64 --request-rate "$rate" --ignore-eos --seed 0 \
      --save-result --result-dir "$OUT" --result-filename "$1_rate$rate.json" > "$OUT/$1_rate$rate.log" 2>&1
    grep -E "Output token throughput|P99 TTFT|P99 ITL" "$OUT/$1_rate$rate.log" | sed "s/^/$1 rate=$rate  /"
  done
}

tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
( export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND="0-$(($(nproc) - 1))"
  [ -e "$tcmalloc" ] && export LD_PRELOAD="$tcmalloc:$V/lib/libiomp5.so"
  exec "$V/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name m \
    --dtype "$DTYPE" --max-model-len 4096 --max-num-seqs 64 --host 127.0.0.1 --port 18090 ) \
  > "$OUT/vllm_server.log" 2>&1 &
server=$!
up 18090 && client vllm 18090
kill "$server"; wait "$server" 2>/dev/null

"$PS" -m pagedserve serve --model "$MODEL" --served-model-name m --dtype "$DTYPE" --max-model-len 4096 \
  --max-num-seqs 64 --kv-cache-memory 4GiB --host 127.0.0.1 --port 18091 > "$OUT/pagedserve_server.log" 2>&1 &
server=$!
up 18091 && client pagedserve 18091
kill "$server"; wait "$server" 2>/dev/null
echo "logs and results in $OUT"
