"""Prefill's integer GEMM on AVX2 (kernels/gguf_gemm_int.inc), at both activation precisions:
gguf_gemm_int16 (int16 activations, every format) and gguf_gemm_int8 (int8 ones, the formats whose
unsigned weights maddubs takes). Every format in both layouts against the scalar integer reference
over the same activations and against the float matmul; a row's result whatever rows share its call;
partial panels, column slices, bias; gguf_gemm's ``auto`` handing float32 prompt chunks to the one
of the layer's precision on the AVX2 path (here under ``--cpu-isa avx2``'s limit where the CPU runs
more); the kernel rows each precision keeps; one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.bench.gguf_kernels import random_gguf_rows
from pagedserve.kernels import isa_paths, kernel_error, limit_isa, native_ops
from pagedserve.models.gguf_linear import (ALL_ROWS, BLOCKS, FLOAT32_INT8_KERNEL_ROWS, FLOAT32_KERNEL_ROWS,
                                           INT8_GEMM_FORMATS, GGUFLinear, kernel_layout, kernel_rows_default,
                                           rows16_layout, widest_format)

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")
PATHS = ["scalar"] + (["avx2"] if "avx2" in isa_paths() else [])
needs_avx2 = pytest.mark.skipif("avx2" not in isa_paths(), reason="this CPU does not run the AVX2 path")
# the formats gguf_gemm_int8 takes: unsigned weights of at most 5 bits
BYTE_FORMATS = list(INT8_GEMM_FORMATS)
# (precision, format) pairs each GEMM computes
CASES = [("int16", f) for f in BLOCKS] + [("int8", f) for f in BYTE_FORMATS]


def _k(fmt):
    """in_features: 10 blocks of 32, or two K-quant super-blocks of 256."""
    return 512 if BLOCKS[fmt][0] == 256 else 320


def _laid(fmt, w, rows16):
    return rows16_layout(fmt, w) if rows16 else kernel_layout(fmt, w)


def _gemm(x, wl, n, fmt, rows16, isa, bias=None, precision="int16"):
    out = torch.empty(x.shape[0], n)
    (OPS.gguf_gemm_int16 if precision == "int16" else OPS.gguf_gemm_int8)(out, x, wl, fmt, bias, rows16, isa)
    return out


@pytest.mark.parametrize("rows16", [True, False])
@pytest.mark.parametrize("precision,fmt", CASES)
def test_products_match_the_integer_reference_and_the_float_matmul(precision, fmt, rows16):
    """Rows 1 to 40 (micro-kernels of every height, row counts split unevenly) over a whole and a
    partial panel of weight rows, with a bias: the AVX2 path gives the scalar integer kernel's values
    (the same integer sums, summed in float in another order) and the float matmul's within the
    activations' rounding (int16: 2e-4 of the largest output; int8: 2e-2)."""
    K, n = _k(fmt), 37
    w = random_gguf_rows(fmt, n, K, seed=5)
    dense = torch.empty(n, K)
    OPS.gguf_dequantize(dense, kernel_layout(fmt, w), fmt)
    wl, bias = _laid(fmt, w, rows16), torch.randn(n)
    torch.manual_seed(1)
    for m in (1, 2, 3, 4, 7, 40):
        x = torch.randn(m, K)
        want = F.linear(x, dense, bias)
        scale = want.abs().max().item()
        ref = _gemm(x, wl, n, fmt, rows16, "scalar", bias, precision)
        assert torch.allclose(ref, want, atol=(2e-4 if precision == "int16" else 2e-2) * scale, rtol=0), m
        for isa in PATHS[1:]:
            got = _gemm(x, wl, n, fmt, rows16, isa, bias, precision)
            assert torch.allclose(got, ref, atol=1e-5 * scale, rtol=0), (m, isa)


@needs_avx2
@pytest.mark.parametrize("precision,fmt", CASES)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(precision, fmt):
    """Each row alone and in chunks of 2, 5 and 13 rows: the micro-kernel does the same operations per
    row at every height, so a prompt's values do not depend on its batch."""
    K, n = _k(fmt), 40
    wl = rows16_layout(fmt, random_gguf_rows(fmt, n, K, seed=6))
    x = torch.randn(13, K)
    whole = _gemm(x, wl, n, fmt, True, "avx2", precision=precision)
    for rows in (1, 2, 5):
        parts = [_gemm(x[i:i + rows].contiguous(), wl, n, fmt, True, "avx2", precision=precision)
                 for i in range(0, 13, rows)]
        assert torch.equal(torch.cat(parts), whole), rows


@needs_avx2
@pytest.mark.parametrize("gemm", ["gguf_gemm_int16", "gguf_gemm_int8"])
def test_a_column_slice_of_a_wider_output_is_written_and_nothing_else(gemm):
    fmt, K, n = "Q5_0", 320, 40
    wl = rows16_layout(fmt, random_gguf_rows(fmt, n, K, seed=9))
    x = torch.randn(7, K)
    whole = _gemm(x, wl, n, fmt, True, "avx2", precision="int16" if gemm.endswith("16") else "int8")
    wide = torch.full((7, n + 24), 5.0)
    getattr(OPS, gemm)(wide[:, 8:8 + n], x, wl, fmt, None, True, "avx2")
    assert torch.equal(wide[:, 8:8 + n], whole)
    assert (wide[:, :8] == 5).all() and (wide[:, 8 + n:] == 5).all()


@needs_avx2
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("fmt", list(BLOCKS))
def test_gguf_gemm_auto_hands_float32_chunks_to_it_on_the_avx2_path(fmt, residual):
    """Where ``auto`` means AVX2 (this CPU's best, or held there by the limit), float32 x goes through
    the integer GEMM of the layer's precision: int16 (``residual``) for every format, but Q6_K only up
    to 32 rows, past which it keeps the float32 GEMM (gguf_gemm_int.inc: int16_gemm_pays); int8 for
    the formats gguf_gemm_int8 takes, Q8_0 and Q6_K as int16. The GEMMs are told apart by their bits."""
    K, n = _k(fmt), 24
    wl = rows16_layout(fmt, random_gguf_rows(fmt, n, K, seed=7))
    for rows in (9, 32, 33):
        x = torch.randn(rows, K)
        limit_isa("avx2")
        try:
            auto = torch.empty(rows, n)
            OPS.gguf_gemm(auto, x, wl, fmt, None, True, "auto", residual)
        finally:
            limit_isa("auto")
        int16 = _gemm(x, wl, n, fmt, True, "avx2")
        chosen = int16 if residual or fmt not in BYTE_FORMATS else _gemm(x, wl, n, fmt, True, "avx2", precision="int8")
        f32 = torch.empty(rows, n)
        OPS.gguf_gemm(f32, x, wl, fmt, None, True, "avx2")
        assert not torch.equal(chosen, f32), rows
        if fmt in BYTE_FORMATS:
            int8 = _gemm(x, wl, n, fmt, True, "avx2", precision="int8")
            assert not torch.equal(int8, int16), rows
        assert torch.equal(auto, f32 if fmt == "Q6_K" and rows > 32 else chosen), rows


def test_a_float32_layer_keeps_its_main_format_s_kernel_rows():
    """Every format has its crossover on the AVX2 and AVX-512 paths in float32, taken by the format of
    most of a layer's rows; other paths and dtypes keep theirs."""
    assert all(set(rows) == set(BLOCKS) for rows in FLOAT32_KERNEL_ROWS.values())
    assert widest_format(["Q5_0", "Q8_0", "Q5_0"], [576, 192, 192]) == "Q5_0"
    assert widest_format(["Q8_0", "Q5_0"], [64, 64]) == "Q8_0"  # a tie: the first
    assert kernel_rows_default("avx2", torch.float32, "Q4_1") == 16
    assert kernel_rows_default("avx2", torch.float32, "Q5_0") == 3
    assert kernel_rows_default("avx2", torch.float32, "Q4_K") == 6
    assert kernel_rows_default("avx512", torch.float32, "Q4_1") == ALL_ROWS
    assert kernel_rows_default("avx512", torch.float32, "Q6_K") == 96
    assert kernel_rows_default("avx2", None, "Q5_0") == kernel_rows_default("avx2") == 32  # no float32 GEMM
    assert kernel_rows_default("avx512", torch.bfloat16, "Q4_1") == 32  # the bf16 GEMM's
    assert kernel_rows_default("amx", torch.float32, "Q4_1") == 32  # the tiles'
    # int8 activations: the AVX2 path's own crossovers against gguf_gemm_int8, others as int16's
    assert set(FLOAT32_INT8_KERNEL_ROWS["avx2"]) == set(BLOCKS)
    assert kernel_rows_default("avx2", torch.float32, "Q4_1", "int8") == 8
    assert kernel_rows_default("avx2", torch.float32, "Q4_K", "int8") == 2
    assert kernel_rows_default("avx2", torch.float32, "Q5_0", "int8") == 2
    assert kernel_rows_default("avx512", torch.float32, "Q4_1", "int8") == ALL_ROWS
    assert kernel_rows_default("avx2", None, "Q5_0", "int8") == 32


@needs_avx2
@pytest.mark.parametrize("residual", [True, False])
def test_a_layer_s_prompt_chunk_past_its_kernel_rows_takes_the_integer_gemm(residual):
    """A Q5_0 + Q8_0 layer (QKV-like) on the AVX2 path: one row past Q5_0's kernel rows gives the
    integer GEMM's bits in each segment's columns (int16, or with int8 activations the int8 GEMM for
    Q5_0 and the int16 one for Q8_0), its kernel rows the integer kernels' at the layer's precision."""
    k = 320
    segments = [("Q5_0", random_gguf_rows("Q5_0", 40, k, seed=1)), ("Q8_0", random_gguf_rows("Q8_0", 16, k, seed=2))]
    precision = "int16" if residual else "int8"
    kept = kernel_rows_default("avx2", torch.float32, "Q5_0", precision)
    x = torch.randn(kept + 1, k)
    limit_isa("avx2")
    try:
        layer = GGUFLinear(segments, k, None, OPS, kernel_rows=kept, gemm=True)
        assert layer.kernel_rows == (3 if residual else 2)
        layer.residual = residual
        chunk, rows = layer(x), layer(x[:kept])
        want_rows = []
        for i, (fmt, w) in enumerate(segments):
            laid, kernel = getattr(layer, f"weight{i}"), OPS.gguf_matmul16 if layer.rows16[i] else OPS.gguf_matmul
            out = torch.empty(kept, w.shape[0])
            kernel(out, x[:kept].contiguous(), laid, fmt, None, residual, "auto")
            want_rows.append(out)
            gemm = "int16" if fmt == "Q8_0" else precision
            assert torch.equal(chunk[:, layer.widths[0] * i:][:, :w.shape[0]],
                               _gemm(x, laid, w.shape[0], fmt, layer.rows16[i], "avx2", precision=gemm)), fmt
    finally:
        limit_isa("auto")
    assert torch.equal(rows, torch.cat(want_rows, dim=1))


def test_bad_calls_are_one_line_errors():
    fmt, K = "Q4_1", 64
    w16 = rows16_layout(fmt, random_gguf_rows(fmt, 16, K))
    x = torch.randn(3, K)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        OPS.gguf_gemm_int16(torch.empty(3, 16), x.bfloat16(), w16, fmt, None, True, "auto")
    with pytest.raises(RuntimeError, match="its paths are scalar and avx2, not avx512"):
        OPS.gguf_gemm_int16(torch.empty(3, 16), x, w16, fmt, None, True, "avx512")
    with pytest.raises(RuntimeError, match=r"uint8 \[2, 640\] in the rows16 layout"):  # 32 outputs: two groups
        OPS.gguf_gemm_int16(torch.empty(3, 32), x, w16, fmt, None, True, "auto")
    with pytest.raises(RuntimeError, match="out must be a float32"):
        OPS.gguf_gemm_int16(torch.empty(3, 16, dtype=torch.bfloat16), x, w16, fmt, None, True, "auto")
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        OPS.gguf_gemm_int16(torch.empty(3, 16), x, w16, fmt, torch.zeros(15), True, "auto")
    q8 = rows16_layout("Q8_0", random_gguf_rows("Q8_0", 16, K))
    with pytest.raises(RuntimeError, match="gguf_gemm_int8: Q8_0's signed weights overflow maddubs"):
        OPS.gguf_gemm_int8(torch.empty(3, 16), x, q8, "Q8_0", None, True, "auto")
    for fmt in set(BLOCKS) - set(INT8_GEMM_FORMATS):  # the Python list is the kernel's, no more
        k = _k(fmt)
        with pytest.raises(RuntimeError, match="signed weights overflow maddubs"):
            OPS.gguf_gemm_int8(torch.empty(3, 16), torch.randn(3, k), rows16_layout(fmt, random_gguf_rows(fmt, 16, k)),
                               fmt, None, True, "auto")
