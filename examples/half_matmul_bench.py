"""The 16-bit-weight kernel (``half_linear``, what ``--decode-weights`` serves decode rows with)
against torch's float32 linears on the same shapes: ``F.linear`` over a float32 weight, and the
oneDNN-prepacked float32 layer the engine otherwise uses on CPU (``PackedLinear``). The candidates
take turns, one timed batch of calls each per round; the figure is the median round, in µs per
call, and GB/s counts the weight bytes each call reads (float32: 4 per weight, the kernel: 2).

Usage: python examples/half_matmul_bench.py [--rows 1,4,16] [--threads N] [--rounds 7] [--shapes small]
(``small``'s shapes: fused QKV 1280x768, output 768x768, fused gate/up 4096x768, down 768x2048,
LM head 32000x768; about 15 s on two AVX2 cores.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels import best_isa, native_ops
from pagedserve.models.packed import PackedLinear, can_pack

SHAPES = {"small": {"qkv": (1280, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048),
                    "lm_head": (32000, 768)},
          "qwen05-shape": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
                           "lm_head": (32000, 896)}}


def round_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16", help="rows of x per call, comma-separated (decode batch sizes)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default="small", choices=list(SHAPES))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = native_ops()
    if ops is None:
        raise SystemExit("the native kernels are unavailable here")
    print(f"{torch.get_num_threads()} threads, kernel path {best_isa()}, median of {args.rounds} alternating rounds")
    print(f"{'matrix':>8} {'N x K':>11} {'rows':>4} | {'F.linear f32':>12} {'oneDNN f32':>10} | "
          f"{'bf16 kernel':>11} {'f16 kernel':>10} | {'bf16 vs F.linear':>16} {'vs oneDNN':>9} | {'GB/s f32 / bf16':>15}")
    torch.manual_seed(0)
    for name, (n, k) in SHAPES[args.shapes].items():
        w = torch.randn(n, k) * 0.02
        bf16, f16 = w.to(torch.bfloat16), w.to(torch.float16)
        packed = PackedLinear(w, None) if can_pack(torch.float32, torch.device("cpu")) else None
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            y = torch.empty(m, n)
            fns = {"linear": lambda: F.linear(x, w), "onednn": (lambda: packed(x)) if packed else None,
                   "bf16": lambda: ops.half_linear(y, x, bf16, None), "f16": lambda: ops.half_linear(y, x, f16, None)}
            fns = {key: fn for key, fn in fns.items() if fn is not None}
            calls = max(1, int(4e6 / (n * k)))  # ~a few ms of calls per round
            times: dict[str, list[float]] = {key: [] for key in fns}
            for fn in fns.values():  # warm-up: oneDNN's first call, page faults
                fn()
            for _ in range(args.rounds):
                for key, fn in fns.items():
                    times[key].append(round_us(fn, calls))
            med = {key: statistics.median(v) for key, v in times.items()}
            onednn = med.get("onednn", float("nan"))
            print(f"{name:>8} {f'{n}x{k}':>11} {m:>4} | {med['linear']:10.1f}us {onednn:8.1f}us | "
                  f"{med['bf16']:9.1f}us {med['f16']:8.1f}us | {med['linear'] / med['bf16']:15.2f}x "
                  f"{onednn / med['bf16']:8.2f}x | {4 * n * k / med['linear'] / 1e3:6.1f} / "
                  f"{2 * n * k / med['bf16'] / 1e3:6.1f}", flush=True)


if __name__ == "__main__":
    main()
