"""The native int4 / grouped-int8 matmul kernels (quant_matmul.cpp) against the dequantized float
matmul: decode-sized and prefill-sized batches, odd output counts, bias, 1 and 2 threads, float32
and bfloat16 activations; the AVX2 path against the portable loop; and the layers' fallback when
the kernels are unavailable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import kernel_error, native_ops
from pagedserve.models.quant import Int4Linear, Int8GroupedLinear

OPS = native_ops()
needs_kernels = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")


def _linear(n_out: int, n_in: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    torch.manual_seed(n_out * 7 + n_in)
    lin = nn.Linear(n_in, n_out, bias=bias)
    if bias:
        nn.init.normal_(lin.bias)
    return lin.to(dtype)


def _int4(linear: nn.Linear, group_size: int = 32, ops=OPS, **kwargs) -> Int4Linear:
    """The layers take the native group kernels only when given them (--group-kernels)."""
    return Int4Linear.from_linear(linear, group_size, group_ops=ops, **kwargs)


def _int8_grouped(n_out: int, n_in: int, bias: bool, dtype: torch.dtype, ops=OPS) -> Int8GroupedLinear:
    torch.manual_seed(n_out + n_in)
    q = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8)
    scales = (torch.rand(n_out, n_in // 32) * 0.01 + 1e-3).to(torch.float16).float()  # a GGUF's f16 scales
    b = torch.randn(n_out).to(dtype) if bias else None
    return Int8GroupedLinear(q, scales, b, 32, dtype, group_ops=ops)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    return torch.allclose(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


def _reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x.float(), layer.dequantized_weight(torch.float32), bias)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_layer_matches_its_dequantized_matmul(kind, bias, dtype, threads):
    for n_out, n_in in ((33, 64), (577, 192)):
        layer = (_int4(_linear(n_out, n_in, bias, dtype)) if kind == "int4"
                 else _int8_grouped(n_out, n_in, bias, dtype))
        assert not getattr(layer, "packed_for_cpu", False) and layer.weight.dtype in (torch.uint8, torch.int8)
        # 1-16 rows: the matrix-vector kernel (tiles of 4 and their remainders); 17 and 40: dequantize + GEMM.
        for rows in (1, 2, 3, 5, 16, 17, 40):
            x = torch.randn(rows, n_in).to(dtype)
            got = layer(x)
            assert got.dtype == dtype and got.shape == (rows, n_out)
            assert _close(got, _reference(layer, x), dtype), (n_out, n_in, rows)


@needs_kernels
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_vector_path_matches_the_portable_loop(kind):
    layer = (_int4(_linear(45, 96, True, torch.float32)) if kind == "int4"
             else _int8_grouped(45, 96, True, torch.float32))
    x = torch.randn(6, 96)
    outs = []
    for scalar in (False, True):
        y = torch.empty(6, 45)
        if kind == "int4":
            OPS.int4_group_matmul(y, x, layer.weight, layer.scales, layer.offsets, layer.bias, scalar)
        else:
            OPS.int8_group_matmul(y, x, layer.weight, layer.scales, layer.bias, scalar)
        outs.append(y)
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-5)
    assert torch.allclose(outs[0], _reference(layer, x), atol=1e-4, rtol=1e-5)


@needs_kernels
def test_float_output_lm_head_and_native_dequantize():
    head = _int8_grouped(50, 64, False, torch.bfloat16)
    head.float_output = True
    x = torch.randn(3, 64).to(torch.bfloat16)
    got = head(x)
    assert got.dtype == torch.float32  # logits summed and kept in float32
    assert torch.allclose(got, _reference(head, x), atol=1e-3, rtol=1e-4)
    lin = _int4(_linear(20, 64, False, torch.float32))
    w = torch.empty(20, 64)
    OPS.group_dequantize(w, lin.weight, lin.scales, lin.offsets)
    assert torch.equal(w, lin.dequantized_weight(torch.float32))


@needs_kernels
def test_bad_operands_are_refused_with_the_op_name():
    lin = _int4(_linear(8, 64, False, torch.float32))
    y = torch.empty(2, 8)
    with pytest.raises(RuntimeError, match="int4_group_matmul: in_features"):
        OPS.int4_group_matmul(y, torch.randn(2, 48), lin.weight, lin.scales, lin.offsets, None)
    with pytest.raises(RuntimeError, match="int4_group_matmul: scales"):
        OPS.int4_group_matmul(y, torch.randn(2, 64), lin.weight, lin.scales.float(), lin.offsets, None)
    with pytest.raises(RuntimeError, match="int8_group_matmul: weight"):
        OPS.int8_group_matmul(y, torch.randn(2, 64), lin.weight, lin.scales, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_without_the_native_kernels_fall_back_to_torch(dtype):
    """No group kernels (the default, no compiler, or --no-native-kernels): int4 takes torch's
    int4pack layout and kernel, grouped int8 its per-group layout; both still match their
    dequantized matmul."""
    int4 = _int4(_linear(48, 64, True, dtype), ops=None)
    readable = _int4(_linear(48, 64, True, dtype), ops=None, packed_for_cpu=False)
    assert int4.packed_for_cpu and not readable.packed_for_cpu
    int8 = _int8_grouped(48, 64, True, dtype, ops=None)
    assert not int8.native and int8.weight.shape == (2, 48, 32)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64).to(dtype)
        want = _reference(readable, x)
        assert torch.allclose(int4(x).float(), want, atol=0.08 * want.abs().max().item(), rtol=0.02)
        assert torch.allclose(readable(x).float(), want, atol=0.05 * want.abs().max().item(), rtol=0.02)
        want8 = _reference(int8, x)
        assert torch.allclose(int8(x).float(), want8, atol=0.02 * want8.abs().max().item(), rtol=0.02)


@needs_kernels
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(kind, threads):
    """Batch invariance up to the kernel's 16 rows: every tile size sums a row in one order, so a
    row alone, at the end of a 3-row tile or inside a 16-row batch gives identical bits (what lets a
    cached re-ask of a chat give the cold answer); and the prefill path, float32 over the exact
    weights, stays within float32 summation error of it."""
    torch.manual_seed(3)
    layer = _int4(_linear(96, 256, False, torch.float32)) if kind == "int4" else \
        _int8_grouped(96, 256, False, torch.float32)
    x = torch.randn(40, 256)
    batch = layer(x[:16])
    for rows in ([5], [4, 5, 6], list(range(2, 16))):
        assert torch.equal(layer(x[rows]), batch[rows])
    prefill = layer(x)  # 40 rows: the dequantize + float32 GEMM path
    assert torch.allclose(prefill[:16], batch, rtol=1e-5, atol=1e-5 * batch.abs().max().item())
