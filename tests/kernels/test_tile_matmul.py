"""bf16 linears over weights packed in AMX-BF16's tile layout (``tile_matmul.cpp``, ``models/packed.py``'s
``TileLinear``).

Every path this CPU runs (the scalar reference always, vdpbf16ps where it has AVX512-BF16, the tiles
where it has AMX-BF16) against a float32 product of the same bf16 operands and against each other:
row counts on both sides of each path's switches (the tiles' 64 rows, vdpbf16ps's 12 and its 6-row
blocks), column counts that leave partial column groups, with and without bias, strided rows in and
out; a row's result the same bits whatever rows share its call; the checks that refuse a shape or
dtype the layout cannot take; and the layer against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import kernel_error, native_ops
from pagedserve.models.packed import TileLinear, pack_linears

OPS = native_ops()
needs_kernels = pytest.mark.skipif(OPS is None, reason=f"native kernels unavailable: {kernel_error()}")

def _paths() -> list[str]:
    """scalar, and each faster path this CPU runs: avx512 wherever amx runs (a limit can ask for it)."""
    best = OPS.tile_linear_path() if OPS is not None else "scalar"
    return {"scalar": ["scalar"], "avx512": ["scalar", "avx512"], "amx": ["scalar", "avx512", "amx"]}[best]


PATHS = _paths()
# tiles: up to 64 rows one B tile meets every row tile, above 32 x 32 blocks; vdpbf16ps: up to 12
# rows two columns meet every row, above four columns meet blocks of 6 (a partial last one at 17, 65, 300)
ROWS = [1, 5, 12, 13, 16, 17, 64, 65, 300]
SHAPES = [(32, 64), (48, 96), (160, 256), (112, 64)]  # 3, 10 and 7 sixteen-feature columns: partial groups


def _operands(n: int, k: int, m: int, bias: bool):
    torch.manual_seed(n * 1000 + k * 10 + m)
    w = (torch.randn(n, k) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    return w, torch.randn(m, k).to(torch.bfloat16), b


def _run(x: torch.Tensor, tiles: torch.Tensor, b, isa: str, n: int) -> torch.Tensor:
    y = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16)
    OPS.tile_linear(y, x, tiles, b, isa)
    return y


def _want(x, w, b) -> torch.Tensor:
    return x.float() @ w.float().t() + (0 if b is None else b.float())


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float32 sums rounded once to bf16 (8 bits): within two of its steps of the largest output."""
    return torch.allclose(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_matches_the_float_product(isa, n, k, m, bias):
    w, x, b = _operands(n, k, m, bias)
    tiles = OPS.tile_pack(w)
    got = _run(x, tiles, b, isa, n)
    assert _close(got, _want(x, w, b))
    if isa != "scalar":  # the same tile products summed in float32 both ways
        assert _close(got, _run(x, tiles, b, "scalar", n).float())


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(isa):
    w, x, b = _operands(160, 256, 300, True)
    tiles = OPS.tile_pack(w)
    whole = _run(x, tiles, b, isa, 160)
    for m in (1, 7, 12, 13, 17, 64, 65, 130):  # every blocking, whole and partial row tiles and blocks
        assert torch.equal(_run(x[:m].contiguous(), tiles, b, isa, 160), whole[:m]), m


@needs_kernels
@pytest.mark.parametrize("isa", PATHS)
def test_strided_rows_in_and_out(isa):
    w, x, b = _operands(48, 96, 70, True)
    tiles = OPS.tile_pack(w)
    wide_x = torch.randn(70, 160).to(torch.bfloat16)
    wide_x[:, 32:128] = x
    wide_y = torch.zeros(70, 80, dtype=torch.bfloat16)
    out = wide_y[:, 16:64]  # rows 80 apart
    OPS.tile_linear(out, wide_x[:, 32:128], tiles, b, isa)
    assert torch.equal(out, _run(x, tiles, b, isa, 48))
    assert not wide_y[:, :16].any() and not wide_y[:, 64:].any()  # nothing written outside the slice


@needs_kernels
def test_the_layout_is_the_tiles_pair_order():
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    tiles = OPS.tile_pack(w)
    assert tiles.shape == (2, 2, 16, 32)
    # tile (features 16-31, inputs 32-63): row r holds inputs 32 + 2r, 33 + 2r of features 16..31 in turn
    t = tiles[1, 1]
    assert torch.equal(t[3, 0::2], w[16:32, 32 + 6]) and torch.equal(t[3, 1::2], w[16:32, 32 + 7])


@needs_kernels
def test_shapes_and_dtypes_the_layout_cannot_take_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.tile_pack(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.tile_pack(torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.tile_pack(torch.zeros(32, 64))
    tiles = OPS.tile_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    y = torch.empty(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        OPS.tile_linear(y, torch.zeros(2, 64), tiles, None)
    with pytest.raises(RuntimeError, match="matching x"):
        OPS.tile_linear(y, torch.zeros(2, 96, dtype=torch.bfloat16), tiles, None)
    with pytest.raises(RuntimeError, match="scalar, avx512 .AVX512-BF16. and amx"):
        OPS.tile_linear(y, torch.zeros(2, 64, dtype=torch.bfloat16), tiles, None, "avx2")


@needs_kernels
def test_the_layer_matches_f_linear_and_packing_picks_it_where_the_cpu_has_tiles():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48, bias=True), nn.Linear(48, 40)).to(torch.bfloat16)  # 40: not tiles
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    want = model(x)
    packed = pack_linears(model, OPS, layout="auto")
    usable = bool(OPS.tile_linear_usable())
    assert isinstance(model[0], TileLinear) == usable and not isinstance(model[1], TileLinear)
    assert packed == 2 or not usable  # where the CPU lacks tiles oneDNN may still pack them
    got = model(x)
    assert got.shape == want.shape and _close(got, want.float())
