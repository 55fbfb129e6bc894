#!/usr/bin/env bash
# The GPU half of issue 37 in one command, for a borrowed card (sized for < 8 minutes on one H200):
#   1. the GPU tests: tests/gpu compiled for the card (the cases `make test` runs in Triton's
#      interpreter, plus bf16 and fp8) and HF parity on CUDA (tests/gpu/test_cuda_parity.py);
#   2. W2 and W1 on `small` and `qwen05-shape` in bf16 (`pagedserve bench gpu-report`): one table
#      with the HBM bandwidth decode achieves at batch 1 and the TFLOP/s prefill achieves, each
#      against the card's own measured copy bandwidth and bf16 matmul rate (docs/BENCHMARKS.md).
# It installs nothing: the checkout's .venv (or $PYTHON) must already hold a CUDA build of torch and
# triton (pip, the hub and transformers are told to stay offline; the standard models are built
# locally from random weights). Exits non-zero if a test fails, after the benchmarks have run.
#
#   scripts/gpu_check.sh            on a machine with a CUDA GPU
#   scripts/gpu_check.sh --dry-run  everything but the CUDA calls, on CPU: the GPU tests collected
#                                   (they run in `make test` under the interpreter) and the report
#                                   on `tiny` at a few tokens; tests/bench/test_gpu_check.py runs it
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

if [ "$dry" = 1 ]; then
  echo "== GPU tests (dry run: collected; on CPU they run in make test under Triton's interpreter)"
  # (no third-party plugins: collecting needs none, and hypothesis and schemathesis take seconds to load)
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only tests/gpu | tail -n 1
  echo "== W2 and W1 (dry run: CPU, tiny, a few tokens)"
  "$PYTHON" -m pagedserve --log-level WARNING bench gpu-report --dry-run
  exit 0
fi

"$PYTHON" - <<'PY'
import sys, torch, triton
if not torch.cuda.is_available():
    sys.exit("no CUDA device here: run scripts/gpu_check.sh --dry-run to check the script on CPU")
print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}")
PY
echo "== GPU tests and HF parity on CUDA"
tests=0
"$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=10 tests/gpu || tests=$?
echo "== W2 and W1 on small and qwen05-shape (bf16)"
"$PYTHON" -m pagedserve --log-level WARNING bench gpu-report --json gpu_report.json
if [ "$tests" != 0 ]; then echo "GPU tests failed (exit $tests): see above" >&2; fi
exit "$tests"
