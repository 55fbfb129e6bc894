"""The rows16 layout of every GGUF format (kernels/gguf_formats.h, gguf_matmul16): the same weights as the
planar layout, dequantized bit for bit alike; its products on every instruction-set path this CPU
runs against the planar kernels' scalar reference and the float matmul; batch invariance; a row
count that is not a multiple of 16; one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.bench.gguf_kernels import random_gguf_rows
from pagedserve.kernels import isa_paths, kernel_error, native_ops
from pagedserve.models.gguf_linear import BLOCKS, ROWS16_FORMATS, kernel_layout, rows16_layout

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")


def _k(fmt):
    """in_features: 19 blocks of 32, or three K-quant super-blocks of 256."""
    return 768 if BLOCKS[fmt][0] == 256 else 608


def _planar(x, w, fmt, residual, isa="scalar", bias=None):
    out = torch.empty(x.shape[0], w.shape[0])
    OPS.gguf_matmul(out, x, kernel_layout(fmt, w), fmt, bias, residual, isa)
    return out


def _rows16(x, w16, n, fmt, residual, isa="auto", bias=None):
    out = torch.empty(x.shape[0], n)
    OPS.gguf_matmul16(out, x, w16, fmt, bias, residual, isa)
    return out


@pytest.mark.parametrize("isa", isa_paths())
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
@pytest.mark.parametrize("n", [16, 37, 3])
def test_layout_holds_the_same_weights(fmt, n, isa):
    """Dequantized on every path (the SIMD ones a group at a time), in every model dtype: the planar
    layout's values bit for bit, rows past the matrix's end never written."""
    K = _k(fmt)
    w = random_gguf_rows(fmt, n, K, seed=n)
    w16 = rows16_layout(fmt, w)
    assert w16.shape == (-(-n // 16), K // BLOCKS[fmt][0] * 16 * BLOCKS[fmt][1])  # GGUF's bytes, 16 rows a group
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want, got = torch.empty(n, K, dtype=dtype), torch.full((n + 1, K), 7.0, dtype=dtype)
        OPS.gguf_dequantize(want, kernel_layout(fmt, w), fmt)
        OPS.gguf_dequantize16(got[:n], w16, fmt, None, isa)
        assert torch.equal(got[:n], want), dtype
        assert (got[n] == 7).all(), dtype


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("isa", isa_paths())
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_every_path_matches_the_planar_reference_and_the_float_matmul(fmt, isa, residual):
    """The VNNI kernel (16 rows a vector) and the other paths (each group rewritten as planar rows)
    sum the same integers: equal to the planar scalar path to float rounding, and to the float
    matmul over the dequantized weights to the activations' precision."""
    n, K = 37, _k(fmt)  # two whole groups and one of 5 rows
    w = random_gguf_rows(fmt, n, K, seed=7)
    dense = torch.empty(n, K)
    OPS.gguf_dequantize(dense, kernel_layout(fmt, w), fmt)
    w16, bias = rows16_layout(fmt, w), torch.randn(n)
    torch.manual_seed(3)
    for m in (1, 2, 3, 4, 5, 9, 33):
        x = torch.randn(m, K)
        got = _rows16(x, w16, n, fmt, residual, isa, bias)
        scale = (x @ dense.T).abs().max().item()
        assert torch.allclose(got, _planar(x, w, fmt, residual, bias=bias), atol=2e-5 * scale, rtol=0), (m, isa)
        assert torch.allclose(got, F.linear(x, dense, bias), atol=(2e-4 if residual else 0.02) * scale, rtol=0), m


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt, residual):
    """On an AMX CPU calls of more than 4 rows run on the tiles, fewer on the VNNI kernel: the same
    bits either way, so a row's result does not depend on the rows beside it."""
    K = _k(fmt)
    w = random_gguf_rows(fmt, 40, K, seed=4)
    w16 = rows16_layout(fmt, w)
    torch.manual_seed(4)
    x = torch.randn(37, K)
    whole = _rows16(x, w16, 40, fmt, residual)
    for lo, hi in ((0, 1), (2, 5), (3, 11), (10, 11), (4, 20), (0, 37)):
        assert torch.equal(_rows16(x[lo:hi].contiguous(), w16, 40, fmt, residual), whole[lo:hi]), (lo, hi)


@pytest.mark.skipif(not {"avx2", "avx512"} <= set(isa_paths()), reason="needs both the AVX2 and AVX-512 paths")
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_avx2_group_kernel_gives_the_vnni_kernels_bits(fmt, residual):
    """AVX2 reads the rows16 layout with maddubs (the same integer sums in int16, no saturation at
    these bounds) and scales them as the VNNI kernel does: equal bits, row counts 1 to 9."""
    n, K = 37, _k(fmt)
    w16, bias = rows16_layout(fmt, random_gguf_rows(fmt, n, K, seed=5)), torch.randn(n)
    torch.manual_seed(5)
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, K) * 3
        assert torch.equal(_rows16(x, w16, n, fmt, residual, "avx2", bias), _rows16(x, w16, n, fmt, residual, "avx512", bias)), m


@pytest.mark.skipif("amx" not in isa_paths(), reason="AMX tiles not available on this CPU")
@pytest.mark.parametrize("residual", [False, True])
def test_tiles_give_the_vnni_kernels_bits(residual):
    """The tiles read Q8_0 rows16 groups as their B operand and scale the exact integer sums as the
    VNNI kernel does: every row count (partial activation tiles, a partial weight group) bit for bit."""
    n, fmt, K = 53, "Q8_0", 608
    w16, bias = rows16_layout(fmt, random_gguf_rows(fmt, n, K, seed=9)), torch.randn(n)
    torch.manual_seed(9)
    for m in (5, 8, 13, 16, 17, 40):  # 5: the VNNI kernel on both; from 8 rows the tiles
        x = torch.randn(m, K)
        assert torch.equal(_rows16(x, w16, n, fmt, residual, "amx", bias), _rows16(x, w16, n, fmt, residual, "avx512", bias)), m


@pytest.mark.parametrize("isa", isa_paths())
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q6_K"])
def test_the_rounded_output_is_the_float_output_as_torch_rounds_it(fmt, isa):
    """`rounded` (the decode stack's bf16 / f16 activations, rounded by each task over its own
    columns, after the tiles by rows): out's values as torch's .to() rounds them, in either layout,
    into a column slice of a wider tensor (a fused layer's segment), the columns beside it untouched."""
    n, K = 37, _k(fmt)
    w = random_gguf_rows(fmt, n, K, seed=5)
    w16, planar, bias = rows16_layout(fmt, w), kernel_layout(fmt, w), torch.randn(n)
    torch.manual_seed(5)
    for m in (1, 5, 17, 40):  # 17, 40: past the AMX tiles' first rows, where this CPU has them
        x = torch.randn(m, K)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for rows16 in (True, False):
                out, wide = torch.empty(m, n), torch.full((m, n + 9), 7.0, dtype=dtype)
                rounded = wide[:, 4:4 + n]
                if rows16:
                    OPS.gguf_matmul16(out, x, w16, fmt, bias, True, isa, rounded)
                else:
                    OPS.gguf_matmul(out, x, planar, fmt, bias, True, isa, rounded)
                assert torch.equal(rounded, out.to(dtype)), (m, dtype, rows16)
                assert (wide[:, :4] == 7).all() and (wide[:, 4 + n:] == 7).all(), (m, dtype, rows16)
    with pytest.raises(RuntimeError, match=r"rounded output must be a \[rows, out_features\] model dtype"):
        OPS.gguf_matmul16(torch.empty(1, n), torch.randn(1, K), w16, fmt, None, True, isa, torch.empty(1, n + 1))
    with pytest.raises(RuntimeError, match=r"rounded output must be a \[rows, out_features\] model dtype"):
        OPS.gguf_matmul(torch.empty(1, n), torch.randn(1, K), planar, fmt, None, True, isa,
                        torch.empty(1, n, dtype=torch.int32))


def test_bad_calls_are_one_line_errors():
    w = random_gguf_rows("Q4_1", 20, 64)
    w16 = rows16_layout("Q4_1", w)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="rows16 layout holds Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, not Q2_K"):
        rows16_layout("Q2_K", w)
    with pytest.raises(RuntimeError, match="unsupported GGUF format 'Q2_K'"):
        OPS.gguf_matmul16(torch.empty(2, 20), x, w16, "Q2_K", None)
    with pytest.raises(RuntimeError, match="in_features 64 is not a multiple of Q4_K's block of 256"):
        OPS.gguf_matmul16(torch.empty(2, 20), x, w16, "Q4_K", None)
    with pytest.raises(RuntimeError, match=r"uint8 \[2, 640\] in the rows16 layout"):
        OPS.gguf_matmul16(torch.empty(2, 20), x, w16[:, :40].contiguous(), "Q4_1", None)
    with pytest.raises(RuntimeError, match=r"uint8 \[1, 640\] in the rows16 layout"):  # 16 outputs: one group
        OPS.gguf_matmul16(torch.empty(2, 16), x, w16, "Q4_1", None)
    with pytest.raises(RuntimeError, match="row id 32 is outside the weight's 32 rows"):
        OPS.gguf_dequantize16(torch.empty(2, 64), w16, "Q4_1", torch.tensor([3, 32]))


def test_the_layout_goes_where_the_cpus_kernels_read_it():
    from pagedserve.models.gguf_linear import rows16_default

    assert rows16_default("avx512") == ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
    assert rows16_default("amx") == ("Q4_0", "Q4_1", "Q8_0")  # the others' batches go to the planar tiles
    assert rows16_default("avx2") == ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")  # maddubs would overflow on Q8_0
    assert rows16_default("scalar") == ()
    from pagedserve.models.gguf_linear import KERNEL_ROWS, kernel_rows_default

    assert kernel_rows_default("avx512") == 128  # the rows16 VNNI kernels beat dequantize + GEMM up to there
    assert kernel_rows_default("avx512", torch.float32) == 128  # ... and the float32 gguf_gemm
    assert kernel_rows_default("avx512", torch.bfloat16) == KERNEL_ROWS  # ... but not the bf16 one past 24-32 rows
    assert [kernel_rows_default(isa) for isa in ("amx", "avx2", "scalar")] == [KERNEL_ROWS] * 3


@pytest.mark.parametrize("rows16", [True, False])
def test_gguf_linear_in_either_layout_computes_the_same_layer(rows16):
    """GGUFLinear lays its segments out in rows16 where asked (by default where the kernels' best path
    reads them so, rows16_default) or planar: decode rows, a prompt chunk (dequantized for the GEMM)
    and row lookups give the float layer's values either way."""
    from pagedserve.models.gguf_linear import GGUFLinear

    k = 768  # whole Q4_K super-blocks
    q, v = random_gguf_rows("Q4_1", 21, k, seed=1), random_gguf_rows("Q8_0", 11, k, seed=2)
    f, s = random_gguf_rows("Q5_0", 6, k, seed=3), random_gguf_rows("Q4_K", 5, k, seed=3)
    layer = GGUFLinear([("Q4_1", q), ("Q8_0", v), ("Q5_0", f), ("Q4_K", s)], k, torch.randn(43), OPS,
                       kernel_rows=8, rows16=rows16)
    assert layer.rows16 == [rows16] * 4
    dense = layer.dequantized_weight(torch.float32)
    planar = torch.empty(21, k)
    OPS.gguf_dequantize(planar, kernel_layout("Q4_1", q), "Q4_1")
    assert torch.equal(dense[:21], planar)
    for residual in (False, True):
        layer.residual = residual
        for rows in (1, 3, 8, 12):  # up to kernel_rows the integer kernels, beyond the GEMM
            x = torch.randn(rows, k)
            want = F.linear(x, dense, layer.bias)
            tolerance = (2e-4 if residual or rows > 8 else 0.02) * want.abs().max().item()
            assert torch.allclose(layer(x), want, atol=tolerance, rtol=0), (residual, rows)
    ids = torch.tensor([[20, 0], [17, 20], [3, 9]])
    for fmt, w in (("Q4_1", q), ("Q8_0", v), ("Q5_0", f), ("Q5_1", random_gguf_rows("Q5_1", 19, k, seed=5)),
                   ("Q4_0", random_gguf_rows("Q4_0", 21, k, seed=4)), ("Q4_K", s),
                   ("Q6_K", random_gguf_rows("Q6_K", 18, k, seed=6))):
        table = GGUFLinear([(fmt, w)], k, None, OPS, rows16=rows16)
        want = torch.empty(w.shape[0], k)
        OPS.gguf_dequantize(want, kernel_layout(fmt, w), fmt)
        ids = ids % w.shape[0]
        assert torch.equal(table.rows(ids, torch.float32), want[ids.reshape(-1)]), fmt
