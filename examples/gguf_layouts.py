"""One token's GGUF matmuls of SmolLM2-135M's shapes, planar rows against the rows16 layout, per
kernel path and activation row count: random blocks of the format, 30 copies of each layer shape
(so no layer is in L2 when it is read) and, with --head, the 49,152 x 576 LM head after them, the
calls made back to back as the decode stack makes them (nothing else in between), alternating
round by round; medians of the rounds, and each layout's ratio against planar rows on the same
path in the same run. docs/BENCHMARKS.md ("Q8_0 in the rows16 layout", "The rows16 layout on AVX2").

    python examples/gguf_layouts.py --format Q8_0 --isa avx512 amx --rows 1 8 16 --head
    python examples/gguf_layouts.py --format Q4_1 --isa avx2 --rows 1 2 4 16
    python examples/gguf_layouts.py --format Q4_K --isa avx512 --rows 1 4 16 --layers 60
"""
import argparse
import statistics
import time

import torch

from pagedserve.bench.gguf_kernels import random_gguf_rows
from pagedserve.kernels import isa_paths, kernel_error, native_ops
from pagedserve.models.gguf_linear import BLOCKS, ROWS16_FORMATS, kernel_layout, rows16_layout

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--format", default="Q4_1", choices=ROWS16_FORMATS, help="the weights' GGUF format")
parser.add_argument("--isa", nargs="+", default=["auto"], help="kernel paths (scalar, avx2, avx512, amx, auto)")
parser.add_argument("--rows", type=int, nargs="+", default=[1], help="activation rows per call")
parser.add_argument("--layers", type=int, default=30, help="copies of each layer shape")
parser.add_argument("--head", action="store_true", help="also the LM head, after the layers")
parser.add_argument("--threads", type=int, default=2, help="torch threads")
parser.add_argument("--rounds", type=int, default=5, help="alternated rounds; medians printed")
parser.add_argument("--int8", action="store_true", help="int8 activations (default: int16, the engine's)")
args = parser.parse_args()

ops = native_ops()
if ops is None:
    raise SystemExit(f"the native kernels are unavailable: {kernel_error()}")
unknown = set(args.isa) - set(isa_paths()) - {"auto"}
if unknown:
    raise SystemExit(f"this CPU runs {', '.join(isa_paths())}; not {', '.join(sorted(unknown))}")
torch.set_num_threads(args.threads)
# The shapes whose rows hold whole blocks of the format (a K-quant's 256: the down projection only)
def fits(shape):
    return shape[1] % BLOCKS[args.format][0] == 0


shapes = list(filter(fits, LAYER_SHAPES)) * args.layers + ([HEAD_SHAPE] if args.head and fits(HEAD_SHAPE) else [])
raw = [random_gguf_rows(args.format, n, k, seed=i) for i, (n, k) in enumerate(shapes)]
layouts = {"planar": [kernel_layout(args.format, w) for w in raw],
           "rows16": [rows16_layout(args.format, w) for w in raw]}
matmul = {"planar": ops.gguf_matmul, "rows16": ops.gguf_matmul16}
weight_bytes = sum(w.numel() for w in layouts["planar"])


def token_us(layout: str, isa: str, m: int) -> float:
    xs = {k: torch.randn(m, k) for k in {k for _, k in shapes}}
    outs = {n: torch.empty(m, n) for n in {n for n, _ in shapes}}
    start = time.perf_counter()
    for (n, k), w in zip(shapes, layouts[layout]):
        matmul[layout](outs[n], xs[k], w, args.format, None, not args.int8, isa)
    return (time.perf_counter() - start) * 1e6


print(f"{args.format}, {len(shapes)} matrices ({weight_bytes / 1e6:.1f} MB), {args.threads} threads, "
      f"{'int8' if args.int8 else 'int16'} activations, medians of {args.rounds} rounds")
for m in args.rows:
    for isa in args.isa:
        for layout in layouts:  # each once first: the weights' pages faulted in, the kernels loaded
            token_us(layout, isa, m)
        times = {layout: [] for layout in layouts}
        for _ in range(args.rounds):
            for layout in layouts:
                times[layout].append(token_us(layout, isa, m))
        planar, rows16 = (statistics.median(times[layout]) for layout in layouts)
        print(f"rows {m:3d}  {isa:7s}  planar {planar:9.0f} us  rows16 {rows16:9.0f} us "
              f"({weight_bytes / rows16 / 1e3:5.1f} GB/s)  rows16/planar speed {planar / rows16:.2f}x")
