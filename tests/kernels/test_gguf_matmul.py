"""The native GGUF kernels (gguf_matmul.cpp) on every block format and every instruction-set path
this CPU runs: dequantization bit for bit against the ``gguf`` package's own dequantizer, the
integer products against the scalar reference and against the float matmul, the int8 activations
identical on every path, the residual (two-pass) activations' precision, batch invariance, strided
outputs, one-line errors; and :class:`GGUFLinear` over them (mixed-format segments, lookups)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedserve.bench.gguf_kernels import random_gguf_rows
from pagedserve.kernels import isa_paths, kernel_error, native_ops
from pagedserve.models.gguf_linear import BLOCKS, GGUFLinear, kernel_layout, row_bytes

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")
FORMATS = list(BLOCKS)
PATHS = isa_paths()


def reference_dequantize(fmt: str, w: torch.Tensor, in_features: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    out = quants.dequantize(w.numpy(), GGMLQuantizationType[fmt])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(w.shape[0], in_features)


def _in_features(fmt: str) -> int:
    # K-quants: two super-blocks; others: 19 blocks, two groups of eight scales and three on their own
    return 512 if BLOCKS[fmt][0] == 256 else 608


def _matmul(x, w, fmt, isa="auto", bias=None, residual=False):
    """The op on GGUF-layout rows ``w`` (put into the kernels' layout first)."""
    out = torch.empty(x.shape[0], w.shape[0])
    OPS.gguf_matmul(out, x, kernel_layout(fmt, w), fmt, bias, residual, isa)
    return out


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_equals_the_gguf_package_bit_for_bit(fmt, isa):
    k = _in_features(fmt)
    w = random_gguf_rows(fmt, 21, k)
    want = reference_dequantize(fmt, w, k)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = torch.empty(21, k, dtype=dtype)
        OPS.gguf_dequantize(got, kernel_layout(fmt, w), fmt, isa)
        assert torch.equal(got, want.to(dtype)), dtype


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_matches_the_scalar_reference_and_the_float_matmul(fmt, isa, threads, residual):
    """Every row count a decode batch or a prefill chunk has (tiles of 4, two weight rows a pass);
    bias; int8 and int16 activations: the integer sums equal the scalar path's float ones to float
    rounding, and the float matmul over the dequantized weight to the activations' precision
    (int8: ~1/254 of each 32 values' maximum)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k, n = _in_features(fmt), 37
        w = random_gguf_rows(fmt, n, k, seed=threads)
        dense = reference_dequantize(fmt, w, k)
        bias = torch.randn(n)
        torch.manual_seed(n)
        for m in (1, 2, 3, 5, 8, 67, 130):
            x = torch.randn(m, k)
            got = _matmul(x, w, fmt, isa, bias, residual)
            scale = (x @ dense.T).abs().max().item()
            assert torch.allclose(got, _matmul(x, w, fmt, "scalar", bias, residual), atol=2e-5 * scale, rtol=0), (m, isa)
            assert torch.allclose(got, F.linear(x, dense, bias), atol=(2e-4 if residual else 0.02) * scale, rtol=0), m
    finally:
        torch.set_num_threads(before)


def _quantized(x, isa, wide):
    q, d, s = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0], x.shape[1] // 32), torch.empty(x.shape[0], x.shape[1] // 32)
    low = torch.empty(x.shape, dtype=torch.int8) if wide else None
    OPS.gguf_quantize_activations(q, d, s, x, isa, low)
    return q, low, d, s


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("isa", PATHS)
def test_every_path_quantizes_activations_to_the_same_integers(isa, wide):
    """int8 (llama.cpp's Q8 activations) and int16 (254 q + low, in units of d / 254: the remainder
    fits a byte without clamping)."""
    torch.manual_seed(1)
    x = torch.randn(9, 256) * torch.logspace(-3, 3, 9).unsqueeze(1)
    x[3, :32] = 0.0  # an all-zero run: scale 0, values 0
    got, want = _quantized(x, isa, wide), _quantized(x, "scalar", wide)
    for a, b in zip(got, want):
        assert a is None and b is None or torch.equal(a, b)
    q, low, d, s = want
    assert q.abs().max().item() == 127 and d[3, 0].item() == 0.0
    value = q.float() if low is None else 254 * q.float() + low.float()
    dq = (value.view(9, 8, 32) * d.unsqueeze(-1)).view(9, 256)
    assert ((dq - x).abs() <= d.repeat_interleave(32, dim=1) * 0.5001).all()  # rounded to nearest
    assert torch.allclose(s, d * value.view(9, 8, 32).sum(-1))
    if wide:
        assert low.abs().max().item() <= 127 and low.abs().max().item() >= 120  # the remainder spans its byte


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q6_K"])
def test_residual_activations_are_a_hundred_times_closer_to_the_float_matmul(fmt):
    k = _in_features(fmt)
    w = random_gguf_rows(fmt, 64, k, seed=3)
    dense = reference_dequantize(fmt, w, k)
    x = torch.randn(3, k) * 3
    want = (x.double() @ dense.double().T)
    err8 = (_matmul(x, w, fmt).double() - want).abs().max().item()
    err16 = (_matmul(x, w, fmt, residual=True).double() - want).abs().max().item()
    assert err16 * 100 < err8, (err8, err16)
    assert err16 < 1e-3 * want.abs().max().item()


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q5_0", "Q4_K"])
@pytest.mark.parametrize("residual", [False, True])
def test_a_rows_result_does_not_depend_on_its_batch(residual, fmt):
    """Each row is quantized and summed on its own, in the same order whatever tile it lands in and
    however many weight rows a pass takes (two for decode batches), so a prompt's logits are the
    same bits alone, in a batch, or after a prefix-cache hit; on an AMX CPU, within batches of up
    to 4 rows and within larger ones (two paths)."""
    k = 512 if fmt == "Q4_K" else 320
    w = random_gguf_rows(fmt, 51, k, seed=4)  # odd: the last weight row of a pass goes alone
    torch.manual_seed(4)
    x = torch.randn(71, k)
    whole = _matmul(x, w, fmt, residual=residual)
    for lo, hi in ((0, 1), (5, 7), (5, 8), (3, 21), (13, 70), (70, 71)):
        # On an AMX CPU, batches of up to 4 rows take the AVX-512 path and larger ones the tiles
        # (gguf_amx.inc): a small batch then matches its rows computed one by one, which the
        # AVX-512 path's own check is; (3, 21) ends in a 2-row tile of a tiled call, whose
        # missing rows are zeros.
        want = whole[lo:hi]
        if "amx" in PATHS and hi - lo <= 4:
            want = torch.cat([_matmul(x[i:i + 1].contiguous(), w, fmt, residual=residual) for i in range(lo, hi)])
        assert torch.equal(_matmul(x[lo:hi].contiguous(), w, fmt, residual=residual), want), (lo, hi)


def test_the_start_up_log_names_the_path_auto_takes():
    from pagedserve.kernels import best_isa, isa_summary

    assert isa_summary().startswith(f"{best_isa()} (") and PATHS[-1] == best_isa()
    if best_isa() == "amx":
        assert "tiles for batches of more than 4 rows" in isa_summary()


def test_output_may_be_a_column_slice_and_activations_any_model_dtype():
    w = random_gguf_rows("Q5_0", 24, 96, seed=5)
    x = torch.randn(4, 96)
    wide = torch.full((4, 40), -7.0)
    OPS.gguf_matmul(wide[:, 10:34], x, kernel_layout("Q5_0", w), "Q5_0", None)
    want = _matmul(x, w, "Q5_0")
    assert torch.equal(wide[:, 10:34], want)
    assert (wide[:, :10] == -7).all() and (wide[:, 34:] == -7).all()
    xb = x.to(torch.bfloat16)
    assert torch.equal(_matmul(xb, w, "Q5_0"), _matmul(xb.float(), w, "Q5_0"))


def test_bad_calls_are_one_line_errors():
    w = random_gguf_rows("Q4_0", 8, 64)
    x = torch.randn(2, 64)
    y = torch.empty(2, 8)
    with pytest.raises(RuntimeError, match="unsupported GGUF format 'Q3_K'"):
        OPS.gguf_matmul(y, x, w, "Q3_K", None)
    with pytest.raises(RuntimeError, match="multiple of Q4_K's block of 256"):
        OPS.gguf_matmul(y, x, w, "Q4_K", None)
    with pytest.raises(RuntimeError, match=r"uint8 \[out_features, 36\]"):
        OPS.gguf_matmul(y, x, w[:, :30].contiguous(), "Q4_0", None)
    with pytest.raises(RuntimeError, match="unknown instruction-set path 'sse9'"):
        _matmul(x, w, "Q4_0", isa="sse9")
    for isa in {"scalar", "avx2", "avx512", "amx"} - set(PATHS):
        with pytest.raises(RuntimeError, match=f"cannot run the {isa} path"):
            _matmul(x, w, "Q4_0", isa=isa)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("Q6_K", 300)


def test_a_layer_of_mixed_formats_computes_each_segment_and_looks_rows_up():
    """A fused QKV from a Q4_K_M file: Q4_K rows then Q6_K rows; decode rows through the kernel,
    prefill rows through the dequantized GEMM, an LM head's float32 logits, and table lookups."""
    k = 256
    q_k = random_gguf_rows("Q4_K", 40, k, seed=6)
    v = random_gguf_rows("Q6_K", 24, k, seed=7)
    bias = torch.randn(64)
    layer = GGUFLinear([("Q4_K", q_k), ("Q6_K", v)], k, bias, OPS, kernel_rows=8)
    dense = torch.cat([reference_dequantize("Q4_K", q_k, k), reference_dequantize("Q6_K", v, k)])
    assert torch.equal(layer.dequantized_weight(torch.float32), dense)
    for rows in (1, 8, 9, 40):  # kernel, kernel, GEMM, GEMM
        x = torch.randn(2, rows, k)
        want = F.linear(x, dense, bias)
        got = layer(x)
        assert got.shape == (2, rows, 64) and got.dtype == torch.float32
        assert torch.allclose(got, want, atol=0.02 * want.abs().max().item(), rtol=0), rows
    assert layer(torch.randn(1, k, dtype=torch.bfloat16)).dtype == torch.bfloat16
    layer.float_output = True
    assert layer(torch.randn(1, k, dtype=torch.bfloat16)).dtype == torch.float32
    table = GGUFLinear([("Q8_0", random_gguf_rows("Q8_0", 30, 64, seed=8))], 64, None, OPS)
    ids = torch.tensor([[3, 0], [29, 3]])
    rows = table.rows(ids, torch.float32)
    assert torch.equal(rows, table.dequantized_weight(torch.float32)[ids.reshape(-1)])
    with pytest.raises(RuntimeError, match="single-format"):
        layer.rows(ids, torch.float32)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 144\]"):
        GGUFLinear([("Q4_K", v)], k, None, OPS)
