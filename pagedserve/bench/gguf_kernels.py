"""``pagedserve bench gguf-kernels``: the native GGUF kernel (int8 or int16 activations × the blocks' integers)
against dequantizing the blocks and running torch's float32 GEMM, against a float32 ``F.linear``
over weights already dequantized (what a float32 model pays), against ``gguf_gemm`` in float32 (the
weights dequantized a panel at a time), on the AVX2 path against the integer GEMM a float32 model's
prompt chunks take there at the same activations (``gguf_gemm_int16``, or ``gguf_gemm_int8`` for the
formats it takes) and, on a CPU with AVX-512 BF16, ``gguf_gemm`` in bf16, at the row counts of a
decode batch and of a prefill chunk, alternating round by round. The crossover row count is where
:class:`~pagedserve.models.gguf_linear.GGUFLinear` switches from the kernel to the GEMM. Each format
is timed in the layout GGUFLinear gives it on this CPU (``rows16_default``), or in the one asked for."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.bench.common import machine_summary, median_call_us, write_result
from pagedserve.config import GGUF_ACTIVATIONS

# (format, out_features, in_features): SmolLM2-135M's fused QKV, gate/up, down and its Q8_0 LM head;
# a Q4_K_M file's K-quants on a 1024-wide model.
SHAPES = [("Q4_1", 960, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576),
          ("Q4_K", 3072, 1024), ("Q6_K", 1024, 3072)]


LAYOUTS = ("auto", "planar", "rows16")


@dataclass
class ShapeTimes:
    format: str
    layout: str  # planar or rows16
    out_features: int
    in_features: int
    rows: int
    kernel_us: float  # medians over the rounds
    dequant_gemm_us: float
    float_us: float
    gemm_us: float | None = None  # gguf_gemm in bf16 (prompt chunks' path on a CPU with AVX-512 BF16)
    gemm_f32_us: float | None = None  # gguf_gemm in float32 (a float32 model's prompt chunks)
    gemm_int_us: float | None = None  # gguf_gemm_int16 / _int8 (the AVX2 path's prompt chunks, the kernels' activations)

    @property
    def gb_per_s(self) -> float:
        """The kernel's weight bytes read per second (one pass over the blocks per call)."""
        from pagedserve.models.gguf_linear import row_bytes

        return self.out_features * row_bytes(self.format, self.in_features) / self.kernel_us / 1e3


def random_gguf_rows(fmt: str, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """``rows`` rows of valid ``fmt`` blocks in GGUF's layout: random integers, and float16 scales of
    a trained model's size (K-quants' super-block scales small, as their 6-bit sub-scales multiply
    them). The kernel tests and this benchmark both time / check such rows."""
    from pagedserve.models.gguf_linear import BLOCKS

    rng = np.random.default_rng(seed)
    elems, size = BLOCKS[fmt]
    nb = in_features // elems
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)

    def put_half(offset: int, lo: float, hi: float) -> None:
        v = rng.uniform(lo, hi, size=(rows, nb)).astype(np.float16)
        raw[..., offset:offset + 2] = v.view(np.uint8).reshape(rows, nb, 2)

    if fmt in ("Q4_0", "Q5_0", "Q8_0"):
        put_half(0, -0.02, 0.02)
    elif fmt in ("Q4_1", "Q5_1"):
        put_half(0, 0.0, 0.02)
        put_half(2, -0.1, 0.1)
    elif fmt in ("Q4_K", "Q5_K"):
        put_half(0, 0.0, 0.002)
        put_half(2, 0.0, 0.002)
    else:  # Q6_K: its d is the block's last two bytes
        put_half(size - 2, -0.002, 0.002)
    if fmt == "Q8_0":  # int8 values as llama.cpp writes them: -127..127
        raw[..., 2:] = rng.integers(-127, 128, size=(rows, nb, 32)).astype(np.int8).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, nb * size))


def _native_ops():
    from pagedserve.kernels import native_ops

    ops = native_ops()
    if ops is None:
        raise RuntimeError("the native kernels are not available here")
    return ops


@dataclass
class LaidOut:
    """Random ``[n, k]`` rows of a format in a layout (``auto``: the one GGUFLinear gives the format
    on this CPU, ``rows16_default``) and the ops that read that layout."""

    layout: str  # planar or rows16
    weight: torch.Tensor
    matmul: object
    dequantize: object  # (out, w, format[, ids, isa] for rows16 | [, isa] for planar)

    @classmethod
    def of(cls, ops, fmt: str, n: int, k: int, layout: str, isa: str = "auto") -> "LaidOut":
        from pagedserve.models.gguf_linear import kernel_layout, rows16_default, rows16_layout

        path = str(ops.best_isa()) if isa == "auto" else isa
        rows16 = fmt in rows16_default(path) if layout == "auto" else layout == "rows16"
        w = (rows16_layout if rows16 else kernel_layout)(fmt, random_gguf_rows(fmt, n, k))
        if rows16:
            return cls("rows16", w, ops.gguf_matmul16, ops.gguf_dequantize16)
        return cls("planar", w, ops.gguf_matmul, ops.gguf_dequantize)


def _alternated(ways, rounds: int, calls: int) -> list[float]:
    """Each way's median µs a call over ``rounds`` rounds taking the ways in turn (so drift hits
    every way alike)."""
    per_way: list[list[float]] = [[] for _ in ways]
    for _ in range(rounds):
        for i, fn in enumerate(ways):
            per_way[i].append(median_call_us(fn, calls))
    return [statistics.median(t) for t in per_way]


def measure(shapes, rows: list[int], rounds: int, calls: int, int16: bool = False,
            layout: str = "auto", isa: str = "auto") -> list[ShapeTimes]:
    from pagedserve.kernels import best_isa
    from pagedserve.models.gguf_linear import INT8_GEMM_FORMATS

    ops = _native_ops()
    # the bf16 GEMM where it runs (on the CPU's own path only), the float32 one on any vector path
    own_gemm = isa == "auto" and bool(ops.gguf_gemm_usable())
    path = best_isa() if isa == "auto" else isa
    own_gemm_f32 = path != "scalar"
    own_gemm_int = path == "avx2"  # the integer GEMM is AVX2's (gguf_gemm_int.inc)
    out: list[ShapeTimes] = []
    for fmt, n, k in shapes:
        laid = LaidOut.of(ops, fmt, n, k, layout, isa)
        w, matmul, rows16 = laid.weight, laid.matmul, laid.layout == "rows16"

        def dequantize(into: torch.Tensor) -> None:
            laid.dequantize(into, w, fmt, *((None, isa) if rows16 else (isa,)))

        dense = torch.empty(n, k)
        dequantize(dense)
        for m in rows:
            x = torch.randn(m, k)
            y = torch.empty(m, n)

            def kernel():
                matmul(y, x, w, fmt, None, int16, isa)

            def dequant_gemm():
                full = torch.empty(n, k)
                dequantize(full)
                return F.linear(x, full)

            def float_gemm():
                return F.linear(x, dense)

            x16, y16 = x.bfloat16(), torch.empty(m, n, dtype=torch.bfloat16)

            def gemm():
                ops.gguf_gemm(y16, x16, w, fmt, None, rows16)

            def gemm_f32():
                ops.gguf_gemm(y, x, w, fmt, None, rows16, isa)

            def gemm_int():  # at the activations' precision, as gguf_gemm's auto takes it
                by_bytes = not int16 and fmt in INT8_GEMM_FORMATS
                (ops.gguf_gemm_int8 if by_bytes else ops.gguf_gemm_int16)(y, x, w, fmt, None, rows16, path)

            extra = {"gemm_f32_us": gemm_f32 if own_gemm_f32 else None,
                     "gemm_int_us": gemm_int if own_gemm_int else None, "gemm_us": gemm if own_gemm else None}
            extra = {name: fn for name, fn in extra.items() if fn is not None}
            times = _alternated((kernel, dequant_gemm, float_gemm, *extra.values()), rounds, calls)
            gemms = dict(zip(extra, times[3:]))
            out.append(ShapeTimes(fmt, laid.layout, n, k, m, *times[:3], **gemms))
    return out


@dataclass
class DequantizeTimes:
    format: str
    layout: str
    out_features: int
    in_features: int
    dtype: str
    path: str  # the instruction-set path (scalar, avx2, avx512)
    us: float  # median over the rounds
    scalar_us: float  # the scalar path's, in the same rounds


def measure_dequantize(formats, rounds: int, calls: int, dtype: torch.dtype, layout: str = "auto",
                       out_features: int = 3072) -> list[DequantizeTimes]:
    """What a prompt chunk pays before its GEMM: one weight (``out_features`` x SmolLM2's 576, or
    1,024 for the K-quants) dequantized into ``dtype`` on every vector path this CPU runs and on
    the scalar reference, alternating round by round."""
    from pagedserve.kernels import isa_paths
    from pagedserve.models.gguf_linear import BLOCKS

    ops = _native_ops()
    paths = [p for p in isa_paths() if p != "amx"]  # the tiles dequantize on the AVX-512 path
    out: list[DequantizeTimes] = []
    for fmt in formats:
        k = 1024 if BLOCKS[fmt][0] == 256 else 576
        laid = LaidOut.of(ops, fmt, out_features, k, layout)
        dense = torch.empty(out_features, k, dtype=dtype)
        rows16 = laid.layout == "rows16"
        ways = [lambda p=p: laid.dequantize(dense, laid.weight, fmt, *((None, p) if rows16 else (p,))) for p in paths]
        medians = _alternated(ways, rounds, calls)
        out += [DequantizeTimes(fmt, laid.layout, out_features, k, str(dtype).removeprefix("torch."), p, us, medians[0])
                for p, us in zip(paths, medians, strict=True) if p != "scalar"]
    return out


def file_shapes(path: Path) -> list[tuple[tuple[str, int, int], int]]:
    """Each ``(format, out_features, in_features)`` among a GGUF file's layer matrices that GGUFLinear
    keeps as blocks (those a prompt chunk multiplies: the token embedding and the LM head aside),
    with how many matrices have it. The engine fuses some of them (QKV, gate/up); timed apart here."""
    from collections import Counter

    from pagedserve.models.gguf import open_gguf_tensors
    from pagedserve.models.gguf_linear import BLOCKS

    found: Counter = Counter()
    for t in open_gguf_tensors(path).tensors:
        if t.tensor_type.name in BLOCKS and len(t.shape) == 2 and t.name.startswith("blk."):
            found[(t.tensor_type.name, int(t.shape[1]), int(t.shape[0]))] += 1
    return sorted(found.items())


def file_totals(counted: list[tuple[tuple[str, int, int], int]], timed: list[ShapeTimes]) -> list[dict]:
    """Per row count, each way's µs summed over the file's matrices (each shape's median x its count)."""
    count = dict(counted)
    totals: dict[int, dict] = {}
    for t in timed:
        row = totals.setdefault(t.rows, {"rows": t.rows, "kernel_us": 0.0, "dequant_gemm_us": 0.0, "float_us": 0.0,
                                         "gemm_f32_us": None, "gemm_int_us": None, "gemm_us": None})
        n = count[(t.format, t.out_features, t.in_features)]
        for way in ("kernel_us", "dequant_gemm_us", "float_us"):
            row[way] += n * getattr(t, way)
        for way in ("gemm_f32_us", "gemm_int_us", "gemm_us"):
            if getattr(t, way) is not None:
                row[way] = (row[way] or 0.0) + n * getattr(t, way)
    return list(totals.values())


def add_parser(bench) -> None:
    p = bench.add_parser("gguf-kernels", help="GGUF kernel vs dequantize + GEMM vs float32, per row count",
                         description=__doc__)
    p.add_argument("--rows", default="1,4,16,32,64,512", help="activation row counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (median reported; >= 1)")
    p.add_argument("--calls", type=int, default=20, help="calls per way per round (median taken; >= 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--gguf-activations", default="int8", choices=list(GGUF_ACTIVATIONS),
                   help="the kernel's activation precision: int8 (this bench's default since it was written, so "
                        "earlier tables' commands measure the same) or int16 (the engine's default, "
                        "--gguf-activations)")
    p.add_argument("--layout", default="auto", choices=LAYOUTS,
                   help="the weights' layout: auto (the one GGUFLinear gives each format on this CPU), planar or "
                        "rows16 (kernels/gguf_formats.h)")
    p.add_argument("--dequantize", action="store_true",
                   help="time instead what a prompt chunk pays before its GEMM: each format's weight dequantized "
                        "on every vector path against the scalar reference (--rows and --gguf-activations unused)")
    p.add_argument("--isa", default="auto", choices=("auto", "scalar", "avx2", "avx512", "amx"),
                   help="the native kernels' path (default: this CPU's best; the one named must run here): "
                        "with MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 in the environment too, an AVX2 "
                        "CPU's ways on an AVX-512 one")
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF file: time its layer matrices' shapes and formats (random blocks) instead of the "
                        "built-in shapes, and print each way's total over the file's matrices per row count")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write the rows as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        print(f"error: --rows must be whole numbers separated by commas, got {args.rows!r}")
        return 2
    if min(rows) < 1 or args.rounds < 1 or args.calls < 1:
        print("error: --rows, --rounds and --calls must be at least 1")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedserve.kernels import best_isa, cpu_has_native_bf16

    if args.dequantize:
        from pagedserve.models.gguf_linear import BLOCKS

        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32  # what --dtype auto computes in
        timed = measure_dequantize(list(BLOCKS), args.rounds, args.calls, dtype, args.layout)
        print(f"GGUF dequantization into {dtype} ({machine_summary()}), medians of {args.rounds} alternated rounds")
        print(f"{'format':6} {'layout':6} {'out x in':>10} {'path':>6} {'us':>8} {'G weights/s':>11} {'scalar us':>10} "
              f"{'x scalar':>8}")
        for t in timed:
            print(f"{t.format:6} {t.layout:6} {f'{t.out_features}x{t.in_features}':>10} {t.path:>6} {t.us:>8.1f} "
                  f"{t.out_features * t.in_features / t.us / 1e3:>11.2f} {t.scalar_us:>10.1f} "
                  f"{t.scalar_us / t.us:>7.2f}x")
        write_result(args.json_out, {"machine": machine_summary(), "dequantize": [asdict(t) for t in timed]})
        return 0
    counted = None
    if args.model is not None:
        if not args.model.is_file():
            print(f"error: --model {args.model} is not a file")
            return 2
        counted = file_shapes(args.model)
        if not counted:
            print(f"error: {args.model} has no layer matrices in a format the GGUF kernels read")
            return 2
    shapes = SHAPES if counted is None else [shape for shape, _ in counted]
    results = measure(shapes, rows, args.rounds, args.calls, args.gguf_activations == "int16", args.layout, args.isa)
    path = best_isa() if args.isa == "auto" else args.isa
    int_gemm = f"{args.gguf_activations} gemm"  # the AVX2 integer GEMM at the kernels' precision
    print(f"GGUF kernels ({path} path, {args.gguf_activations} activations; {machine_summary()}), medians "
          f"of {args.rounds} alternated rounds")
    print(f"{'format':6} {'layout':6} {'out x in':>12} {'rows':>5} {'kernel us':>10} {'GB/s':>6} {'deq+GEMM us':>12} "
          f"{'fp32 us':>9} {'GEMM/kernel':>11} {'fp32/kernel':>11}"
          + (f" {'f32 gguf_gemm us':>16} {'deq+GEMM/f32':>12}" if results and results[0].gemm_f32_us else "")
          + (f" {int_gemm + ' us':>13} {'f32/' + int_gemm[:-5]:>9}" if results and results[0].gemm_int_us else "")
          + (f" {'bf16 gguf_gemm us':>17} {'kernel/gguf_gemm':>16}" if results and results[0].gemm_us else ""))
    for r in results:
        print(f"{r.format:6} {r.layout:6} {f'{r.out_features}x{r.in_features}':>12} {r.rows:>5} {r.kernel_us:>10.1f} "
              f"{r.gb_per_s:>6.1f} {r.dequant_gemm_us:>12.1f} {r.float_us:>9.1f} "
              f"{r.dequant_gemm_us / r.kernel_us:>10.2f}x {r.float_us / r.kernel_us:>10.2f}x"
              + (f" {r.gemm_f32_us:>16.1f} {r.dequant_gemm_us / r.gemm_f32_us:>11.2f}x" if r.gemm_f32_us else "")
              + (f" {r.gemm_int_us:>13.1f} {r.gemm_f32_us / r.gemm_int_us:>8.2f}x" if r.gemm_int_us else "")
              + (f" {r.gemm_us:>17.1f} {r.kernel_us / r.gemm_us:>15.2f}x" if r.gemm_us else ""))
    totals = None
    if counted is not None:
        totals = file_totals(counted, results)
        print(f"{args.model.name}: {sum(n for _, n in counted)} layer matrices, each way's total per row count")
        print(f"{'rows':>5} {'kernel ms':>10} {'deq+GEMM ms':>12} {'fp32 ms':>9}"
              + (f" {'f32 gguf_gemm ms':>16}" if totals[0]["gemm_f32_us"] else "")
              + (f" {int_gemm + ' ms':>13}" if totals[0]["gemm_int_us"] else "")
              + (f" {'gguf_gemm ms':>12} {'kernel/gguf_gemm':>16}" if totals[0]["gemm_us"] else ""))
        for t in totals:
            print(f"{t['rows']:>5} {t['kernel_us'] / 1e3:>10.2f} {t['dequant_gemm_us'] / 1e3:>12.2f} "
                  f"{t['float_us'] / 1e3:>9.2f}"
                  + (f" {t['gemm_f32_us'] / 1e3:>16.2f}" if t["gemm_f32_us"] else "")
                  + (f" {t['gemm_int_us'] / 1e3:>13.2f}" if t["gemm_int_us"] else "")
                  + (f" {t['gemm_us'] / 1e3:>12.2f} {t['kernel_us'] / t['gemm_us']:>15.2f}x" if t["gemm_us"] else ""))
    write_result(args.json_out, {"isa": best_isa(), "machine": machine_summary(),
                                 "rows": [asdict(r) for r in results]} | ({"totals": totals} if totals else {}))
    return 0
