"""Prefill's GEMM over GGUF weights (gguf_gemm): every format in both layouts; bf16 activations (bf16
and float32 out) on the AVX-512 BF16 kernel (kernels/gguf_gemm.inc) where this CPU has it, float32 ones
on the AVX2 and AVX-512 kernels (kernels/gguf_gemm_f32.inc) where it runs them, the scalar reference
always; the kernels' weights bit for bit the dequantizer's; column slices of a wider output;
GGUFLinear sending prompt chunks through it; one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.bench.gguf_kernels import random_gguf_rows
from pagedserve.kernels import best_isa, gguf_gemm_usable, isa_paths, kernel_error, native_ops
from pagedserve.models.gguf_linear import BLOCKS, KERNEL_ROWS, GGUFLinear, kernel_layout, rows16_layout

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")


def _kernel_runs() -> bool:
    """Whether the bf16 kernel runs here: on any CPU with AVX-512 BF16 (GGUFLinear calls it only
    where gguf_gemm_usable, which leaves AMX-BF16 CPUs to torch's GEMM; the tests run it there too)."""
    try:
        OPS.gguf_gemm(torch.empty(1, 16), torch.zeros(1, 32, dtype=torch.bfloat16),
                      rows16_layout("Q4_0", random_gguf_rows("Q4_0", 16, 32)), "Q4_0", None, True, "auto")
    except RuntimeError as e:
        assert "no AVX-512 BF16" in str(e)
        return False
    return True


PATHS = ["scalar"] + (["auto"] if OPS is not None and _kernel_runs() else [])
# float32 activations: the scalar reference, and each vector path this CPU runs (AMX machines run the AVX-512 one)
F32_PATHS = ["scalar"] + [p for p in isa_paths() if p in ("avx2", "avx512")]
# (activations' dtype, path)
X_PATHS = [(torch.bfloat16, p) for p in PATHS] + [(torch.float32, p) for p in F32_PATHS if p != "scalar"]


def _k(fmt):
    """in_features: 10 blocks of 32, or two K-quant super-blocks of 256."""
    return 512 if BLOCKS[fmt][0] == 256 else 320


def _laid(fmt, w, rows16):
    return rows16_layout(fmt, w) if rows16 else kernel_layout(fmt, w)


def _dense32(fmt, w):
    dense = torch.empty(w.shape[0], _k(fmt))
    OPS.gguf_dequantize(dense, kernel_layout(fmt, w), fmt)
    return dense


def _gemm(x, wl, n, fmt, rows16, isa, dtype=torch.float32, bias=None):
    out = torch.empty(x.shape[0], n, dtype=dtype)
    OPS.gguf_gemm(out, x, wl, fmt, bias, rows16, isa)
    return out


@pytest.mark.parametrize("rows16", [True, False])
@pytest.mark.parametrize("fmt", list(BLOCKS))
def test_every_path_reads_the_dequantized_weights_bit_for_bit(fmt, rows16):
    """Identity rows of x read the weights back: each output is one weight times 1, so the kernels'
    packed panels (straight from the rows16 groups for the 32-weight formats, or dequantized then
    transposed) must be gguf_dequantize's weights exactly (bf16 for bf16 x, float32 for float32 x), on
    every path, partial panels too."""
    K = _k(fmt)
    for n in (16, 37, 64):
        w = random_gguf_rows(fmt, n, K, seed=n)
        for dtype, paths in ((torch.bfloat16, PATHS), (torch.float32, F32_PATHS)):
            want = torch.empty(n, K, dtype=dtype)
            OPS.gguf_dequantize(want, kernel_layout(fmt, w), fmt)
            for isa in paths:
                got = _gemm(torch.eye(K, dtype=dtype), _laid(fmt, w, rows16), n, fmt, rows16, isa)
                assert torch.equal(got.T, want.float()), (n, dtype, isa)


@pytest.mark.parametrize("rows16", [True, False])
@pytest.mark.parametrize("fmt", list(BLOCKS))
def test_products_match_the_reference_and_the_float_matmul(fmt, rows16):
    """Random rows (1 to 30: micro-kernels of every height, a row count split unevenly) against the
    scalar reference (float32 sums in k order: the kernel's differ in order only) and against the
    float matmul over the dequantized weights, with a bias, in float32 and bf16 out."""
    K, n = _k(fmt), 50  # a whole panel of 32 and one of 18 columns
    w = random_gguf_rows(fmt, n, K, seed=3)
    dense = torch.empty(n, K, dtype=torch.bfloat16)
    OPS.gguf_dequantize(dense, kernel_layout(fmt, w), fmt)
    wl, bias = _laid(fmt, w, rows16), torch.randn(n)
    torch.manual_seed(0)
    for m in (1, 5, 13, 30):
        x = torch.randn(m, K).bfloat16()
        want = F.linear(x.float(), dense.float(), bias)
        scale = want.abs().max().item()
        ref = _gemm(x, wl, n, fmt, rows16, "scalar", bias=bias)
        assert torch.allclose(ref, want, atol=1e-5 * scale, rtol=0), m
        for isa in PATHS:
            got = _gemm(x, wl, n, fmt, rows16, isa, bias=bias)
            assert torch.allclose(got, ref, atol=1e-5 * scale, rtol=0), (m, isa)
            got16 = _gemm(x, wl, n, fmt, rows16, isa, torch.bfloat16, bias)
            assert torch.allclose(got16.float(), ref, atol=8e-3 * scale, rtol=0), (m, isa)
        x32 = torch.randn(m, K)  # float32 activations, the weights exact: the float matmul's values
        want = F.linear(x32, _dense32(fmt, w), bias)
        for isa in F32_PATHS:
            got = _gemm(x32, wl, n, fmt, rows16, isa, bias=bias)
            assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item(), rtol=0), (m, isa)


@pytest.mark.parametrize(("dtype", "isa"), X_PATHS)
def test_a_column_slice_of_a_wider_output_is_written_and_nothing_else(dtype, isa):
    fmt, K, n = "Q4_1", 320, 40
    w = random_gguf_rows(fmt, n, K, seed=9)
    x = torch.randn(7, K).to(dtype)
    whole = _gemm(x, rows16_layout(fmt, w), n, fmt, True, isa, dtype)
    wide = torch.full((7, n + 24), 5.0, dtype=dtype)
    OPS.gguf_gemm(wide[:, 8:8 + n], x, rows16_layout(fmt, w), fmt, None, True, isa)
    assert torch.equal(wide[:, 8:8 + n], whole)
    assert (wide[:, :8] == 5).all() and (wide[:, 8 + n:] == 5).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gemm", [True, False])
def test_gguf_linear_sends_prompt_chunks_through_it(gemm, dtype):
    """A mixed-format layer (QKV-like segments, one partial group each) with a bias: a prompt chunk in
    bf16 or float32 through gguf_gemm or through dequantize + torch's GEMM gives the float layer's
    values; the integer kernels keep the rows up to kernel_rows."""
    if gemm and {torch.bfloat16: "auto" not in PATHS, torch.float32: F32_PATHS == ["scalar"]}[dtype]:
        pytest.skip(f"no {dtype} gguf_gemm kernel on this CPU")  # (GGUFLinear(gemm=True) is asked for the kernel)
    k = 512
    segments = [("Q4_1", random_gguf_rows("Q4_1", 21, k, seed=1)), ("Q8_0", random_gguf_rows("Q8_0", 11, k, seed=2)),
                ("Q4_K", random_gguf_rows("Q4_K", 37, k, seed=3))]
    layer = GGUFLinear(segments, k, torch.randn(69), OPS, gemm=gemm)
    assert layer.gemm is gemm
    dense = layer.dequantized_weight(dtype).float()
    x = torch.randn(layer.kernel_rows + 40, k).to(dtype)
    want = F.linear(x.float(), dense, layer.bias)
    got = layer(x)
    assert got.dtype == dtype
    # bf16 rounding; in float32 exact products, but on the AVX2 path the int16 GEMM's activations
    # (gguf_gemm_int16) for all but Q6_K
    tolerance = 8e-3 if dtype == torch.bfloat16 else 2e-4 if gemm and best_isa() == "avx2" else 1e-5
    assert torch.allclose(got.float(), want, atol=tolerance * want.abs().max().item(), rtol=0)
    layer.float_output = True  # an LM head's prompt logprobs: float32 out
    assert layer(x).dtype == torch.float32


def test_the_gemm_is_chosen_where_the_cpu_has_avx512_bf16_without_amx_tiles_and_in_float32_on_every_vector_path():
    assert gguf_gemm_usable() == ("auto" in PATHS and OPS.tile_linear_path() != "amx")
    assert gguf_gemm_usable(torch.float32) == (F32_PATHS != ["scalar"])
    assert not gguf_gemm_usable(torch.float16)


def test_the_gemm_takes_prompt_chunks_from_32_rows():
    layer = GGUFLinear([("Q4_0", random_gguf_rows("Q4_0", 16, 64))], 64, None, OPS, gemm=True)
    assert layer.kernel_rows == KERNEL_ROWS == 32


def test_bad_calls_are_one_line_errors():
    fmt, K = "Q4_1", 64
    w16 = rows16_layout(fmt, random_gguf_rows(fmt, 16, K))
    x = torch.randn(3, K).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16 or float32"):
        OPS.gguf_gemm(torch.empty(3, 16), x.half(), w16, fmt, None, True, "scalar")
    with pytest.raises(RuntimeError, match=r"out must be a float32 \(or, for bfloat16 x, bfloat16\)"):
        OPS.gguf_gemm(torch.empty(3, 16, dtype=torch.float16), x, w16, fmt, None, True, "scalar")
    with pytest.raises(RuntimeError, match=r"out must be a float32"):  # float32 x: float32 out only
        OPS.gguf_gemm(torch.empty(3, 16, dtype=torch.bfloat16), x.float(), w16, fmt, None, True, "scalar")
    with pytest.raises(RuntimeError, match=r"uint8 \[2, 640\] in the rows16 layout"):  # 32 outputs: two groups
        OPS.gguf_gemm(torch.empty(3, 32), x, w16, fmt, None, True, "scalar")
    with pytest.raises(RuntimeError, match=r"uint8 \[16, 40\] of Q4_1 blocks"):
        OPS.gguf_gemm(torch.empty(3, 16), x, w16, fmt, None, False, "scalar")
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        OPS.gguf_gemm(torch.empty(3, 16), x, w16, fmt, torch.zeros(15), True, "scalar")
    if "auto" not in PATHS:
        with pytest.raises(RuntimeError, match="no AVX-512 BF16"):
            OPS.gguf_gemm(torch.empty(3, 16), x, w16, fmt, None, True, "auto")
