"""``pagedserve bench gpu-report``: the benchmark half of ``scripts/gpu_check.sh`` — W2 and W1 per
model on a GPU, set against what the card itself measures.

Per model it reports:

* **W2** (one request, 16-token prompt, 256 outputs): decode tokens/s at batch 1, and the HBM
  bandwidth that rate implies: each decode step reads every weight once and the request's KV
  cache so far, so ``(weight bytes + KV bytes/token × mean context) × tokens/s``;
* **W1 prefill**: W1's 64 prompts (64-512 tokens) run with one output token each, the TFLOP/s
  that achieves: ``2 × (parameters in the decoder layers) × prompt tokens`` plus the causal
  attention's ``2 × 2 × layers × heads × head_dim × n²/2`` per prompt, over the wall time;
* **W1**: output tokens/s of the whole workload (prompts and all outputs, continuous batching).

and, measured on the same card first, the two rates the issue's bars are fractions of: the
device-to-device copy bandwidth (bytes read + written / time over a 1 GiB copy) and the bf16
matmul rate (8192³). ``--dry-run`` runs all of it on the CPU (``tiny`` by default, each workload
cut to a few requests and tokens, small probes): every step but the CUDA calls, so the script is
known to work before a card is borrowed.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass

import torch

from pagedserve.bench.common import median, resolve_model, write_result
from pagedserve.bench.workloads import w1_offline, w2_single_stream

GPU_MODELS = ["small", "qwen05-shape"]


def add_parser(bench) -> None:
    p = bench.add_parser("gpu-report", help="W2 and W1 on a GPU: HBM bandwidth at batch 1 and prefill TFLOP/s, "
                                            "against the card's measured copy bandwidth and bf16 matmul rate",
                         description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None,
                   help=f"standard model names or directories (default: {' '.join(GPU_MODELS)}; tiny with --dry-run)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16; float32 with --dry-run)")
    p.add_argument("--dry-run", action="store_true",
                   help="everything on the CPU at a small size: checks the report end to end without a GPU")
    p.add_argument("--json", dest="json_out", default=None, help="write the rows as JSON to this file")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class CardRates:
    copy_gb_s: float  # device-to-device copy: bytes read + written per second, GB/s
    matmul_tflop_s: float  # square matmul in the benchmark dtype


@dataclass(frozen=True)
class ModelRow:
    model: str
    attention_backend: str
    w2_decode_tok_s: float
    bytes_per_decode_token: int
    w2_hbm_gb_s: float
    prefill_tokens: int
    prefill_tflop_s: float
    w1_output_tok_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return median(times)


def measure_card(device: torch.device, dtype: torch.dtype, copy_bytes: int, matmul_n: int, repeats: int) -> CardRates:
    """The card's own copy bandwidth and matmul rate, the yardsticks of the report's percentages."""
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device, repeats)
    a = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    mm_s = _timed(lambda: a @ b, device, repeats)
    return CardRates(2 * copy_bytes / copy_s / 1e9, 2 * matmul_n ** 3 / mm_s / 1e12)


def _run(engine, requests, max_tokens) -> float:
    """Seconds to run ``requests`` (all added at once) to completion, greedy."""
    from pagedserve.engine.sampling_params import SamplingParams

    for i, req in enumerate(requests):
        engine.add_request(str(i), req.prompt_token_ids,
                           SamplingParams(max_tokens=max_tokens(req), temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    _sync(engine.core.device)
    return time.perf_counter() - start


def prefill_flops(model, prompt_lens: list[int]) -> float:
    """Floating-point operations of prefilling these prompts (one chunk each, causal attention)."""
    arch = model.arch
    layer_params = sum(p.numel() for p in model.layers.parameters())
    attention = 2 * 2 * arch.num_layers * arch.num_heads * arch.head_dim
    return sum(2 * layer_params * n + attention * n * n / 2 for n in prompt_lens)


@dataclass(frozen=True)
class Sizes:
    """How much of each workload runs: all of it on a card, a token of each on a dry run."""

    w2_output: int = 256
    w1_requests: int = 64
    w1_max_output: int = 256


FULL, DRY = Sizes(), Sizes(w2_output=12, w1_requests=4, w1_max_output=4)


def measure_model(name: str, dtype: str, device: torch.device, sizes: Sizes) -> ModelRow:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    engine = Engine(EngineConfig(model=resolve_model(name), dtype=dtype, device=str(device), max_model_len=2048,
                                 kv_cache_memory="auto" if device.type == "cuda" else "256MiB"))
    try:
        return _measure(engine, name, sizes)
    finally:
        engine.close()


def _measure(engine, name: str, sizes: Sizes) -> ModelRow:
    vocab = engine.core.arch.vocab_size
    w2 = w2_single_stream(vocab_size=vocab)
    w2.output_len = min(w2.output_len, sizes.w2_output)
    _run(engine, [w2], lambda r: 8)  # warm-up: kernels compiled, graphs already captured
    # Decode rate: the 255 tokens after the first, timed apart from the prompt's step.
    first = _run(engine, [w2], lambda r: 1)
    whole = median([_run(engine, [w2], lambda r: r.output_len) for _ in range(3)])
    decode_tok_s = (w2.output_len - 1) / max(whole - first, 1e-9)
    mean_context = len(w2.prompt_token_ids) + w2.output_len / 2
    bytes_per_token = int(engine.core.weight_bytes + engine.core.kv.bytes_per_token * mean_context)

    w1 = w1_offline(sizes.w1_requests, vocab_size=vocab)
    for r in w1:
        r.output_len = min(r.output_len, sizes.w1_max_output)
    _run(engine, w1[:4], lambda r: 2)  # warm-up of the prefill kernels' shapes
    engine.core.block_manager.reset_prefix_cache()
    prefill_s = _run(engine, w1, lambda r: 1)
    engine.core.block_manager.reset_prefix_cache()
    prompt_lens = [len(r.prompt_token_ids) for r in w1]
    w1_s = _run(engine, w1, lambda r: r.output_len)
    return ModelRow(name, engine.core.config.attention_backend, decode_tok_s, bytes_per_token,
                    bytes_per_token * decode_tok_s / 1e9, sum(prompt_lens),
                    prefill_flops(engine.core.runner.model, prompt_lens) / prefill_s / 1e12,
                    sum(r.output_len for r in w1) / w1_s)


def format_table(card: CardRates, rows: list[ModelRow], device: str, dtype: str) -> str:
    lines = [f"GPU check on {device} ({dtype}): copy {card.copy_gb_s:.0f} GB/s, matmul {card.matmul_tflop_s:.1f} "
             "TFLOP/s (measured here)",
             "| model | backend | W2 decode tok/s | bytes/token | HBM GB/s at batch 1 | % of copy | "
             "prefill TFLOP/s | % of matmul | W1 output tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.attention_backend} | {r.w2_decode_tok_s:.1f} | "
                     f"{r.bytes_per_decode_token / 2**20:.1f} MiB | "
                     f"{r.w2_hbm_gb_s:.1f} | {100 * r.w2_hbm_gb_s / card.copy_gb_s:.0f} % | {r.prefill_tflop_s:.2f} | "
                     f"{100 * r.prefill_tflop_s / card.matmul_tflop_s:.0f} % | {r.w1_output_tok_s:.1f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        device, models, dtype = torch.device("cpu"), args.models or ["tiny"], "float32"
        card = measure_card(device, torch.float32, copy_bytes=16 * 2**20, matmul_n=256, repeats=2)
        sizes = DRY
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu-report needs a CUDA device (or --dry-run)")
        device, models, dtype = torch.device("cuda"), args.models or GPU_MODELS, args.dtype
        card = measure_card(device, getattr(torch, dtype), copy_bytes=2**30, matmul_n=8192, repeats=10)
        sizes = FULL
    rows = []
    for name in models:
        rows.append(measure_model(name, dtype, device, sizes))
        # The engine took most of the card for its KV pool (auto): give it back before the next one sizes its own.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(format_table(card, rows, str(device) + (" (dry run)" if args.dry_run else ""), dtype))
    write_result(args.json_out, {"card": asdict(card), "rows": [asdict(r) for r in rows], "dtype": dtype,
                                 "device": str(device), "dry_run": args.dry_run})
    return 0
