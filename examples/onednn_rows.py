"""TFLOP/s of oneDNN's prepacked bf16 linear (the engine's PackedLinear) for `small`'s four linear
shapes (and its LM head, with --head) at a range of row counts, on 1 and 2 threads: where its own
threading leaves a core idle, and how fast a decode step's weights stream. docs/BENCHMARKS.md
("W1 on the Sapphire Rapids-class Xeon: the heap, the token budget"; "Decode attention on the
Sapphire Rapids-class Xeon").

    python examples/onednn_rows.py
    python examples/onednn_rows.py --rows 16 32 64 128 --head   # decode-sized batches
"""
import argparse
import time

import torch

SHAPES = {"qkv 1280 x 768": (1280, 768), "o_proj 768 x 768": (768, 768), "gate_up 4096 x 768": (4096, 768),
          "down 768 x 2048": (768, 2048)}
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 768, 1024, 1280, 1536, 2048],
                    help="row counts (tokens in a step)")
parser.add_argument("--head", action="store_true", help="also the LM head, 32000 x 768")
args = parser.parse_args()
ROWS = args.rows
if args.head:
    SHAPES["lm_head 32000 x 768"] = (32000, 768)


def timed(x: torch.Tensor, packed: torch.Tensor, calls: int = 20) -> float:
    """Seconds per call."""
    run = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    for _ in range(3):
        run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


torch.manual_seed(0)
with torch.inference_mode():
    for threads in (1, 2):
        torch.set_num_threads(threads)
        print(f"{threads} thread(s), TFLOP/s (µs a call, GB/s of weights) at rows "
              + " ".join(f"{m:>20}" for m in ROWS))
        for name, (n_out, k) in SHAPES.items():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n_out, k, dtype=torch.bfloat16), None)
            seconds = [timed(torch.randn(m, k, dtype=torch.bfloat16), packed) for m in ROWS]
            print(f"  {name:20s}" + " ".join(
                f"{2 * m * k * n_out / s / 1e12:5.2f} ({s * 1e6:5.0f}, {2 * k * n_out / s / 1e9:4.1f})"
                for m, s in zip(ROWS, seconds)))
