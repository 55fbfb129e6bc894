"""Weight-only int8 / int4 linear layers: kernels against their dequantized reference, bytes, replacement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.quant import Int4Linear, Int8Linear, quantize_int4_groups, quantize_model, weight_bytes


def _linear(n_out=96, n_in=128, bias=False, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    if bias:
        nn.init.normal_(lin.bias)
    return lin.to(dtype)


def test_int8_error_is_half_a_step_per_channel():
    lin = _linear(dtype=torch.float32)
    q = Int8Linear.from_linear(lin)
    w = lin.weight
    assert q.weight.dtype == torch.int8 and q.scales.shape == (96,)
    assert ((q.dequantized_weight(torch.float32) - w).abs() <= q.scales.unsqueeze(1) / 2 + 1e-7).all()


@pytest.mark.parametrize("bias", [False, True])
def test_int8_cpu_kernel_matches_the_dequantized_matmul(bias):
    lin = _linear(bias=bias)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(5, 128).to(torch.bfloat16)
    ref = F.linear(x.float(), q.dequantized_weight(torch.float32), None if lin.bias is None else lin.bias.float())
    got = q(x)  # bf16 on CPU: aten._weight_int8pack_mm
    assert got.dtype == torch.bfloat16 and got.shape == (5, 96)
    assert torch.allclose(got.float(), ref, atol=0.05, rtol=0.02)
    # float32 activations take the fallback: int8 -> float, matmul, per-channel scale.
    got32 = q(x.float().unsqueeze(0)).squeeze(0)
    assert torch.allclose(got32, ref, atol=0.02, rtol=0.01)


def test_int4_error_is_half_a_step_per_group():
    w = torch.randn(16, 64)
    q, scales, zeros = quantize_int4_groups(w, 32)
    assert q.min() >= 0 and q.max() <= 15 and scales.shape == (16, 2)
    deq = ((q.view(16, 2, 32).float() - 8) * scales.unsqueeze(-1) + zeros.unsqueeze(-1)).view(16, 64)
    assert ((deq - w).abs().view(16, 2, 32) <= scales.unsqueeze(-1) / 2 + 1e-6).all()
    with pytest.raises(ValueError):
        quantize_int4_groups(torch.randn(4, 48), 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_cpu_kernel_matches_the_portable_fallback(dtype):
    lin = _linear(bias=True, dtype=dtype)
    fast = Int4Linear.from_linear(lin, 32, packed_for_cpu=True)
    portable = Int4Linear.from_linear(lin, 32, packed_for_cpu=False)
    x = torch.randn(7, 128).to(dtype)
    ref = F.linear(x.float(), portable.dequantized_weight(torch.float32), lin.bias.float())
    assert torch.allclose(portable(x).float(), ref, atol=0.05, rtol=0.02)
    assert torch.allclose(fast(x).float(), ref, atol=0.08, rtol=0.02)
    if fast.packed_for_cpu:  # torch's int4pack layout (no native kernels): opaque
        with pytest.raises(RuntimeError):
            fast.dequantized_weight(torch.float32)
    else:  # the native kernels read the readable layout
        assert torch.equal(fast.dequantized_weight(torch.float32), portable.dequantized_weight(torch.float32))


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 128)
        self.norm = nn.LayerNorm(128)
        self.block = nn.Sequential(nn.Linear(128, 256, bias=False), nn.Linear(256, 128, bias=False))

    def forward(self, ids):
        return self.block(self.norm(self.embed(ids)))


@pytest.mark.parametrize("kind,cls,ratio", [("int8", Int8Linear, 0.5), ("int4", Int4Linear, 0.25)])
def test_quantize_model_replaces_linears_and_shrinks_their_bytes(kind, cls, ratio):
    model = _Toy().to(torch.bfloat16)
    linear_bytes = sum(m.weight.nbytes for m in model.block)
    other = weight_bytes(model) - linear_bytes
    ids = torch.tensor([1, 2, 3])
    before = model(ids).float()
    quantize_model(model, kind)
    assert all(isinstance(m, cls) for m in model.block)
    assert model.embed.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.bfloat16
    quant_bytes = weight_bytes(model) - other
    # The weights take 1/2 (int8) or 1/4 (int4) of bf16; scales (and zeros) add a few percent.
    assert ratio * linear_bytes < quant_bytes < (ratio + 0.15) * linear_bytes
    after = model(ids).float()
    assert (after - before).norm() / before.norm() < (0.02 if kind == "int8" else 0.2)
    with pytest.raises(ValueError):
        quantize_model(_Toy(), "int3")
