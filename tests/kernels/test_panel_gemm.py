"""The float32 panel linear kernel (``panel_gemm.cpp``) against a float64 matmul: every row-block
split (1-6 rows per micro-kernel, 8 rows as 4 + 4), a ragged last panel, bias, strided rows and a
K longer than one slice; and pack_linears choosing it for float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.kernels import kernel_error, native_ops
from pagedserve.models.packed import PackedLinear, PanelLinear, can_pack, pack_linears

OPS = native_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13, 40])
@pytest.mark.parametrize("n, k, bias", [(37, 300, True), (64, 48, False)])
def test_panel_linear_matches_float64(m, n, k, bias):
    torch.manual_seed(m)
    w, x = torch.randn(n, k), torch.randn(m, k)
    b = torch.randn(n) if bias else None
    out = torch.full((m, n), float("nan"))
    OPS.panel_linear(out, x, OPS.panel_pack(w), b)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert torch.allclose(out.double(), want, atol=1e-4, rtol=1e-4)


def test_panel_linear_reads_strided_rows_and_refuses_a_mismatch():
    torch.manual_seed(0)
    w, wide = torch.randn(40, 32), torch.randn(9, 96)
    x = wide[:, 16:48]  # rows of 32, 96 apart (a split of a fused projection's output)
    layer = nn.Linear(32, 40)
    layer.weight.data, layer.bias.data = w, torch.randn(40)
    panel = PanelLinear(layer.weight, layer.bias, OPS)
    assert torch.allclose(panel(x), layer(x), atol=1e-5)
    assert torch.allclose(panel(x.reshape(3, 3, 32)), layer(x.reshape(3, 3, 32)), atol=1e-5)
    with pytest.raises(RuntimeError, match="panel_linear"):
        OPS.panel_linear(torch.empty(9, 40), torch.randn(9, 31), OPS.panel_pack(w), None)


def test_pack_linears_puts_float32_into_panels_and_the_onednn_layout_keeps_onednn():
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64, bias=False)).eval()
    model = make()
    x = torch.randn(5, 64)
    want = model(x)
    assert pack_linears(model, OPS, layout="panel") == 2
    assert all(isinstance(m, PanelLinear) for m in model)
    assert torch.allclose(model(x), want, atol=1e-5)
    if can_pack(torch.float32, torch.device("cpu")):
        other = make()
        pack_linears(other, OPS, layout="onednn")
        assert all(isinstance(m, PackedLinear) for m in other)
