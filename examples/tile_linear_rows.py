"""A step's linears of `small` (12 layers x qkv, o_proj, gate_up, down, and the LM head up to 64 rows)
through the native tile-layout kernel (the engine's TileLinear, `--pack-weights auto`: AMX-BF16
tiles, or AVX512-BF16's vdpbf16ps where there are none) and through oneDNN's prepacked bf16 linear
(PackedLinear, `--pack-weights onednn`), per row count, the two timed in turn on the same operands:
where the kernel wins and where it does not. By default one layer's matrices are called again and
again (in cache); `--from-memory` gives each of the 12 layers its own weights and times whole steps,
so that the weights stream from memory as in a decode step. docs/BENCHMARKS.md ("bf16 linears on
AMX-BF16 tiles"; "bf16 linears through vdpbf16ps").

    python examples/tile_linear_rows.py
    python examples/tile_linear_rows.py --rows 1 64 --threads 1
    python examples/tile_linear_rows.py --from-memory --rows 1 4 16 64 512
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
parser.add_argument("--from-memory", action="store_true",
                    help="12 layers' own weights, whole steps timed: the weights stream from memory")
args = parser.parse_args()
ops = native_ops()
if ops is None or not ops.tile_linear_usable():
    raise SystemExit("this CPU (or build) has neither AMX-BF16 tiles nor AVX512-BF16 for the tile-layout kernel")
torch.set_num_threads(args.threads)
torch.manual_seed(0)


def per_call(layer, x: torch.Tensor | None, calls: int) -> float:
    """Median seconds of ``layer(x)`` (``layer()`` where ``x`` is None) after 3 warm-up calls."""
    run = layer if x is None else lambda: layer(x)
    for _ in range(3):
        run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def from_memory() -> None:
    """Every layer's own matrices, a whole step's linears timed at once, the two kinds in turn."""
    names = [name for name in SHAPES if name != "lm_head"] * 12 + ["lm_head"]
    weights = [(torch.randn(*SHAPES[name]) / SHAPES[name][1] ** 0.5).to(torch.bfloat16) for name in names]
    tile = [TileLinear(w, None, ops) for w in weights]
    packed = [PackedLinear(w, None) for w in weights]
    for m in args.rows:
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (768, 2048)}

        def step(layers):
            return lambda: [layer(xs[layer.in_features]) for layer in layers]

        calls = 11 if m <= 128 else 3
        times = {"tile": [], "onednn": []}
        for _ in range(2):  # in turn, twice
            times["tile"].append(per_call(step(tile), None, calls))
            times["onednn"].append(per_call(step(packed), None, calls))
        t, o = min(times["tile"]), min(times["onednn"])
        print(f"  {m:5d} rows: kernel {t * 1e3:7.2f}  oneDNN {o * 1e3:7.2f}  kernel/oneDNN speed {o / t:.2f}x")


def in_cache() -> None:
    """One layer's matrices called again and again, each timed alone; a step's total per row count."""
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
        print(f"  {m:5d} rows: kernel {tiles * 1e3:7.2f}  oneDNN {onednn * 1e3:7.2f}  "
              f"kernel/oneDNN speed {onednn / tiles:.2f}x")


with torch.inference_mode():
    print(f"the tile-layout kernel's path here: {ops.tile_linear_path()}")
    if args.from_memory:
        print(f"{args.threads} thread(s): ms of a step's linears, weights from memory (12 layers and the LM head)")
        from_memory()
    else:
        in_cache()
