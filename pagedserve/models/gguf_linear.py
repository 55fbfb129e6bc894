"""GGUF's quantized blocks as a linear layer, computed by the native kernels without leaving them.

A :class:`GGUFLinear` holds a weight matrix's bytes exactly as the GGUF file stores them (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks, one row of blocks per output feature; the
32-weight formats' bytes regrouped per row into planes, :func:`kernel_layout`) and multiplies it
two ways (``pagedserve/kernels/gguf_matmul.cpp``):

* up to ``kernel_rows`` rows of activations (decode batches, short prompt chunks:
  :func:`kernel_rows_default`): ``gguf_matmul`` reads the blocks once and multiplies their
  integers with the activations quantized per 32 values to int8, as llama.cpp does; float32 out.
  An LM head (``float_output``) takes int16 activations (an int8 byte and the int8 of its
  remainder, joined in the kernel's integer sums): near-tied logits keep their order.
* more rows (prefill chunks): on a CPU with AVX-512 BF16 (and no AMX tiles), bf16 activations go through
  ``gguf_gemm``, which dequantizes 32 weight rows at a time into a buffer that stays in cache and
  multiplies every row of the chunk with them (``kernels/gguf_gemm.inc``); float32 ones through its
  float32 form on the AVX2 and AVX-512 paths (``kernels/gguf_gemm_f32.inc``), where the model's
  builder asks for it; elsewhere the blocks are dequantized once per call into a float matrix of the
  activations' dtype and torch's GEMM of that dtype runs over it.

A fused layer (QKV, gate/up) whose parts have different formats (a Q4_K_M file mixes Q4_K and
Q6_K) holds one segment per run of output rows with the same format; each segment writes its
columns of the output. A table (the token embedding) looks rows up with :meth:`rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# format → (weights per block, bytes per block), as GGUF lays them out
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}

# Up to this many activation rows the integer kernel runs, beyond them dequantize + GEMM, on a CPU
# without AVX-512 VNNI (kernel_rows_default). Measured on SmolLM2-135M's shapes (docs/QUANTIZATION.md,
# "GGUF kernels").
KERNEL_ROWS = 32


# Kernel rows that never hand over: the integer kernels take every row count.
ALL_ROWS = 1 << 30
# Computing in float32 (a CPU without native bf16, or --dtype float32), the rows up to which each
# format's integer kernels beat the GEMM that takes the chunks past them, per path: bench
# gguf-kernels on SmolLM2-135M's Q4_1, Q8_0 and Q4_K_M files on a Zen 5 (docs/BENCHMARKS.md, "An
# int16 GEMM for prompt chunks on AVX2", "An int8 GEMM ..."); Q4_0 and Q5_1 take their kin's (Q4_1,
# Q5_0). AVX2 (against gguf_gemm_int16; Q6_K past 32 rows the float32 gguf_gemm): Q4_1's kernels
# stay ahead to 16 rows, Q4_K's to 6, Q8_0's and Q5_K's to 4, Q5_0's and Q6_K's to 3 (Q4_1's were
# ahead to 128, the K-quants' to 16 and Q6_K's to 8 until the GEMM's panels came straight from the
# rows16 groups).
# AVX-512 VNNI (against the float32 gguf_gemm): Q4_1's, Q5_0's and Q8_0's rows16 kernels still
# 1.2-1.4x ahead at 512 rows, the K-quants' level with it at 512-1,024, Q6_K's to 96.
FLOAT32_KERNEL_ROWS = {
    "avx2": {"Q4_0": 16, "Q4_1": 16, "Q5_0": 3, "Q5_1": 3, "Q8_0": 4, "Q4_K": 6, "Q5_K": 4, "Q6_K": 3},
    "avx512": {"Q4_0": ALL_ROWS, "Q4_1": ALL_ROWS, "Q5_0": ALL_ROWS, "Q5_1": ALL_ROWS, "Q8_0": ALL_ROWS,
               "Q4_K": 1024, "Q5_K": 1024, "Q6_K": 96},
}
# The same with int8 activations (--gguf-activations int8), where they differ: on AVX2 the kernels
# against gguf_gemm_int8, whose maddubs over the panels' 4- and 5-bit weights runs 1.35-1.9x the
# int16 GEMM (Q8_0 and Q6_K: against the int16 GEMM, which they keep); docs/BENCHMARKS.md, "An int8
# GEMM for prompt chunks on AVX2". The int8 kernels stay ahead to 8 rows on Q4_0 / Q4_1 and Q6_K,
# 2 on Q5_0 / Q5_1 and the K-quants; Q8_0 keeps int16's 4 (its planar int8 kernels level with the
# int16 GEMM at 16 rows in cache, but a 16-stream step streaming the weights ran 1.10x faster
# through the GEMM).
FLOAT32_INT8_KERNEL_ROWS = {
    "avx2": {"Q4_0": 8, "Q4_1": 8, "Q5_0": 2, "Q5_1": 2, "Q8_0": 4, "Q4_K": 2, "Q5_K": 2, "Q6_K": 8},
}


# The formats AVX2's int8 GEMM takes (kernels/gguf_gemm_int.inc, int8_gemm_takes: unsigned weights of
# at most 5 bits, which maddubs multiplies without overflow); Q8_0 and Q6_K compute int16 there.
INT8_GEMM_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K")


def kernel_rows_default(isa: str, gemm: torch.dtype | None = None, fmt: str | None = None,
                        activations: str = "int16") -> int:
    """The most activation rows GGUFLinear gives the integer kernels on a CPU whose kernels' best
    path is ``isa``, ``gemm`` the dtype of the ``gguf_gemm`` that takes the rows past them (None:
    dequantize + torch's GEMM does), ``fmt`` the format holding most of the layer's weights
    (:func:`widest_format`), ``activations`` the kernels' (``int16`` or ``int8``). On AVX-512:
    KERNEL_ROWS before the bf16 GEMM (AVX-512 BF16, no AMX),
    which is level with the rows16 kernels at 24-32 rows and 1.2-1.4x faster at 64 (every format of
    SmolLM2-135M's and Gemma 3 270M's files, docs/BENCHMARKS.md, "Prefill's own GEMM"); 128 before a
    float32 one (whose rows16 kernels prefilled a 64-token prompt 1.6-2.1x and a 128-token one
    1.2-1.5x faster than dequantize + torch's GEMM, "The integer kernels up to 128 rows", and stay
    ahead of the float32 GEMM there, "The float32 GEMM"). Before a float32 GEMM on the AVX2 and
    AVX-512 paths with ``fmt`` given: the format's own crossover (FLOAT32_KERNEL_ROWS, or
    FLOAT32_INT8_KERNEL_ROWS with int8 activations; ALL_ROWS: the kernels take every chunk).
    KERNEL_ROWS elsewhere (AMX tiles keep their own)."""
    if gemm == torch.float32 and fmt is not None and isa in FLOAT32_KERNEL_ROWS:
        if activations == "int8" and isa in FLOAT32_INT8_KERNEL_ROWS:
            return FLOAT32_INT8_KERNEL_ROWS[isa][fmt]
        return FLOAT32_KERNEL_ROWS[isa][fmt]
    return KERNEL_ROWS if isa != "avx512" or gemm == torch.bfloat16 else 128


def widest_format(formats: list[str], widths: list[int]) -> str:
    """The format of the most output rows among a layer's segments (``formats``, ``widths``; ties: the
    first): all segments share in_features, so the one holding most of the layer's weights."""
    rows: dict[str, int] = {}
    for fmt, width in zip(formats, widths, strict=True):
        rows[fmt] = rows.get(fmt, 0) + int(width)
    return max(rows, key=rows.__getitem__)


def kernel_layout(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF rows of ``fmt`` blocks (uint8 ``[rows, row bytes]``) in the kernels' layout: for the
    32-weight formats, every block's integer bytes, then every d, then every m (Q4_1, Q5_1) — the
    same bytes regrouped, so the kernel converts eight blocks' scales at once (gguf_formats.h);
    K-quants as they are."""
    elems, size = BLOCKS[fmt]
    if elems != 32:
        return blocks.contiguous()
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, size)
    head = 4 if fmt in ("Q4_1", "Q5_1") else 2  # d (and m), float16 each
    planes = [b[..., head:], b[..., 0:2]] + ([b[..., 2:4]] if head == 4 else [])
    return torch.cat([p.reshape(rows, -1) for p in planes], dim=1).contiguous()


ROWS16_FORMATS = tuple(BLOCKS)
# Where each format's float16 fields (d; m or dmin) lie in its block: the rows16 layout keeps them
# behind the other bytes
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def rows16_default(isa: str) -> tuple[str, ...]:
    """The formats GGUFLinear lays out in rows16 on a CPU whose kernels' best path is ``isa``: those
    its group kernels read as they lie (AVX-512 VNNI: all of them; AMX: Q4_0, Q4_1 and Q8_0, its other
    batches measured on the planar tiles only; AVX2: all but Q8_0, whose w + 128 would overflow its
    ``maddubs`` sums, so it has no group kernel for it); planar elsewhere
    (docs/BENCHMARKS.md, "The rows16 layout", "Q8_0 in the rows16 layout", "The rows16 layout on
    AVX2", "Measured 2026-12-06 on an AMD EPYC Zen 5", "K-quants in the rows16 layout")."""
    by_isa = {"avx512": ROWS16_FORMATS, "amx": ("Q4_0", "Q4_1", "Q8_0"),
              "avx2": tuple(f for f in ROWS16_FORMATS if f != "Q8_0")}
    return by_isa.get(isa, ())


def rows16_layout(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF rows of ``fmt`` blocks (uint8 ``[rows, row bytes]``) in the rows16 layout
    (kernels/gguf_formats.h): per 16 rows (the last group padded with zero rows) and block, the
    block's bytes but its float16 fields (its "body", Q8_0's stored as w + 128) as 64-byte vectors,
    vector j holding each row's body bytes 4j..4j+3, then the 16 rows' d and (Q4_1, Q5_1, Q4_K,
    Q5_K) their m or dmin — uint8 ``[ceil(rows / 16), blocks x block bytes]``."""
    if fmt not in ROWS16_FORMATS:
        raise ValueError(f"the rows16 layout holds {', '.join(ROWS16_FORMATS)}, not {fmt}")
    size, halves = BLOCKS[fmt][1], HALVES[fmt]
    body = [i for i in range(size) if not any(h <= i < h + 2 for h in halves)]
    rows, qb = blocks.shape[0], len(body)
    groups = -(-rows // 16)
    b = torch.zeros(groups * 16, blocks.shape[1], dtype=torch.uint8)
    b[:rows] = blocks
    b = b.reshape(groups, 16, -1, size).transpose(1, 2)  # [group, block, row, block bytes]
    n = b.shape[1]
    quants = b[..., body].reshape(groups, n, 16, qb // 4, 4).transpose(2, 3).reshape(groups, n, 16 * qb)
    if fmt == "Q8_0":
        quants = quants ^ 0x80  # w + 128 (two's complement): unsigned bytes
    parts = [quants] + [b[..., h:h + 2].reshape(groups, n, 32) for h in halves]
    return torch.cat(parts, dim=2).reshape(groups, -1).contiguous()


def row_bytes(fmt: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` weights in ``fmt``."""
    elems, size = BLOCKS[fmt]
    if in_features % elems:
        raise ValueError(f"{fmt} rows hold whole blocks of {elems} weights; in_features {in_features} is not one")
    return in_features // elems * size


class GGUFLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` in GGUF blocks: ``segments`` is ``[(format, uint8 [rows, row_bytes])]``
    stacked along the output dimension; ``bias`` float ``[out]`` or None; ``ops`` the native namespace."""

    def __init__(self, segments: list[tuple[str, torch.Tensor]], in_features: int, bias: torch.Tensor | None,
                 ops, kernel_rows: int | None = None, rows16: bool | None = None, gemm: bool | None = None):
        super().__init__()
        self.in_features = in_features
        self.formats = [fmt for fmt, _ in segments]
        self.widths = [int(w.shape[0]) for _, w in segments]
        self.out_features = sum(self.widths)
        # Segments in the rows16 layout where this CPU's kernels read it (rows16_default), or every
        # rows16 format (True) or none (False) where asked.
        isa = str(ops.best_isa())
        chosen = rows16_default(isa) if rows16 is None else ROWS16_FORMATS if rows16 else ()
        self.rows16 = [fmt in chosen for fmt in self.formats]
        for i, (fmt, w) in enumerate(segments):
            if fmt not in BLOCKS:
                raise ValueError(f"no native kernel for GGUF format {fmt}")
            if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != row_bytes(fmt, in_features):
                raise ValueError(f"{fmt} weight must be uint8 [rows, {row_bytes(fmt, in_features)}], "
                                 f"got {w.dtype} {tuple(w.shape)}")
            self.register_buffer(f"weight{i}", rows16_layout(fmt, w) if self.rows16[i] else kernel_layout(fmt, w))
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.ops = ops
        # Each segment's kernel and dequantization, by its layout
        self.matmuls = [ops.gguf_matmul16 if r else ops.gguf_matmul for r in self.rows16]
        self.dequantizers = [ops.gguf_dequantize16 if r else ops.gguf_dequantize for r in self.rows16]
        # Prompt chunks through gguf_gemm (default: in bf16 where the CPU has AVX-512 BF16 and no AMX;
        # GGUFBuilder asks for float32 ones too), else dequantized whole for torch's GEMM
        self.gemm = bool(ops.gguf_gemm_usable()) if gemm is None else gemm
        default_rows = kernel_rows_default(isa, torch.bfloat16 if self.gemm else None)
        self.kernel_rows = default_rows if kernel_rows is None else kernel_rows
        self.float_output = False  # True for an LM head: float32 logits
        # Activations quantized to ~16 bits (int8 plus the int8 of its remainder) rather than 8: an LM head
        # always (int8 moved SmolLM2's near-tied logits enough to flip a greedy pick), the other
        # layers when the engine asks (EngineConfig.gguf_activations)
        self.residual = False

    def _segments(self):
        """Per segment: its format, weight, output columns ``[offset, offset + width)``, index and bias slice."""
        offset = 0
        for i, (fmt, width) in enumerate(zip(self.formats, self.widths)):
            bias = None if self.bias is None else self.bias[offset:offset + width]
            yield fmt, getattr(self, f"weight{i}"), offset, width, i, bias
            offset += width

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight this layer computes with, ``[out, in]`` (exact in float32)."""
        out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        for fmt, w, offset, width, i, _ in self._segments():
            self.dequantizers[i](out[offset:offset + width], w, fmt)
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight: a quantized embedding's lookups."""
        if len(self.formats) != 1:
            raise RuntimeError("row lookups need a single-format table")
        ids = ids.reshape(-1)
        out = torch.empty(ids.numel(), self.in_features, dtype=dtype)
        if self.rows16[0]:  # each id's bytes out of its group of 16
            self.ops.gguf_dequantize16(out, self.weight0, self.formats[0], ids)
        else:
            self.ops.gguf_dequantize(out, self.weight0.index_select(0, ids), self.formats[0])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.kernel_rows:
            # The decode hot path: one native call per segment, nothing else allocated but y.
            x2 = x2.contiguous()
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            if len(self.formats) == 1:  # _buffers read directly: nn.Module's __getattr__ costs ~1 us a name
                buffers = self._buffers
                self.matmuls[0](y, x2, buffers["weight0"], self.formats[0], buffers["bias"], self.residual)
            else:
                for fmt, w, offset, width, i, bias in self._segments():
                    self.matmuls[i](y[:, offset:offset + width], x2, w, fmt, bias, self.residual)
            if not self.float_output and x.dtype != torch.float32:
                y = y.to(x.dtype)
        elif self.gemm and x2.dtype in (torch.bfloat16, torch.float32):
            # A panel of the weight dequantized at a time, into the order the kernel reads
            x2 = x2.contiguous()
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32 if self.float_output else x.dtype)
            for fmt, w, offset, width, i, bias in self._segments():
                self.ops.gguf_gemm(y[:, offset:offset + width], x2, w, fmt, bias, self.rows16[i], "auto", self.residual)
        else:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = F.linear(x2, self.dequantized_weight(x.dtype), bias)
            if self.float_output:
                y = y.float()
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"GGUF {'+'.join(dict.fromkeys(self.formats))}")
