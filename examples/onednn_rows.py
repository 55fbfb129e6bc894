"""TFLOP/s of oneDNN's prepacked bf16 linear (the engine's PackedLinear) for `small`'s four linear
shapes at a range of row counts, on 1 and 2 threads: where its own threading leaves a core idle.
docs/BENCHMARKS.md ("W1 on the Sapphire Rapids-class Xeon: the heap, the token budget").

    python examples/onednn_rows.py
"""
import time

import torch

SHAPES = {"qkv 1280 x 768": (1280, 768), "o_proj 768 x 768": (768, 768), "gate_up 4096 x 768": (4096, 768),
          "down 768 x 2048": (768, 2048)}
ROWS = (256, 512, 768, 1024, 1280, 1536, 2048)


def tflops(x: torch.Tensor, packed: torch.Tensor, n_out: int, calls: int = 20) -> float:
    run = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    for _ in range(3):
        run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    seconds = (time.perf_counter() - start) / calls
    return 2 * x.shape[0] * x.shape[1] * n_out / seconds / 1e12


torch.manual_seed(0)
with torch.inference_mode():
    for threads in (1, 2):
        torch.set_num_threads(threads)
        print(f"{threads} thread(s), TFLOP/s at rows " + " ".join(f"{m:>6}" for m in ROWS))
        for name, (n_out, k) in SHAPES.items():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n_out, k, dtype=torch.bfloat16), None)
            row = [tflops(torch.randn(m, k, dtype=torch.bfloat16), packed, n_out) for m in ROWS]
            print(f"  {name:20s}" + " ".join(f"{t:6.2f}" for t in row))
