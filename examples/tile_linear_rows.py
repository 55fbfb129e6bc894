"""A step's linears of `small` (12 layers x qkv, o_proj, gate_up, down, and the LM head up to 64 rows)
through the AMX-BF16 tile kernel (the engine's TileLinear, `--pack-weights auto`) and through
oneDNN's prepacked bf16 linear (PackedLinear, `--pack-weights onednn`), per row count, the two
timed in turn on the same operands: where the tiles win and where they do not. docs/BENCHMARKS.md
("bf16 linears on AMX-BF16 tiles").

    python examples/tile_linear_rows.py
    python examples/tile_linear_rows.py --rows 1 64 --threads 1
"""
import argparse
import statistics
import time

import torch

from pagedserve.kernels import native_ops
from pagedserve.models.packed import PackedLinear, TileLinear

SHAPES = {"qkv": (1280, 768), "o_proj": (768, 768), "gate_up": (4096, 768), "down": (768, 2048),
          "lm_head": (32000, 768)}
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 34, 64, 128, 512, 1024, 2048],
                    help="row counts (tokens in a step); the LM head is counted up to 64 rows")
parser.add_argument("--threads", type=int, default=2, help="torch threads")
args = parser.parse_args()
ops = native_ops()
if ops is None or not ops.tile_linear_usable():
    raise SystemExit("this CPU (or build) has no AMX-BF16 tile path")
torch.set_num_threads(args.threads)
torch.manual_seed(0)


def per_call(layer, x: torch.Tensor, calls: int) -> float:
    for _ in range(3):
        layer(x)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


with torch.inference_mode():
    layers = {}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) / k ** 0.5).to(torch.bfloat16)
        layers[name] = (TileLinear(w, None, ops), PackedLinear(w, None))
    print(f"{args.threads} thread(s): ms of a step's linears (12 layers, the LM head up to 64 rows)")
    for m in args.rows:
        tiles = onednn = 0.0
        for name, (tile, packed) in layers.items():
            if name == "lm_head" and m > 64:
                continue
            x = torch.randn(m, SHAPES[name][1], dtype=torch.bfloat16)
            calls = 20 if m <= 64 else 5
            reps = 1 if name == "lm_head" else 12
            tiles += reps * per_call(tile, x, calls)
            onednn += reps * per_call(packed, x, calls)
        print(f"  {m:5d} rows: tiles {tiles * 1e3:7.2f}  oneDNN {onednn * 1e3:7.2f}  tiles/oneDNN speed {onednn / tiles:.2f}x")
