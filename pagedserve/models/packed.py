"""Linear layers with their weights prepacked once at load, for faster CPU matmuls.

Three packings. bfloat16 weights on a CPU with AMX-BF16 (Sapphire Rapids and later) or AVX512-BF16
(Zen 4 / Zen 5, Cooper Lake), where the native kernels build, go into the tiles' own layout for
``tile_linear`` (``tile_matmul.cpp``; ``--pack-weights auto``, the default), which multiplies them on
the tiles or, without AMX-BF16, with ``vdpbf16ps``. Against oneDNN's prepacked linears on ``small``'s
shapes, 2 threads: on the tiles a step's linears ran 1.14-1.33x as fast from 1 to 1,024 rows and
0.87x at 2,048, one stream 1.26x and W1 level; with ``vdpbf16ps`` on a Zen 4, 1.9-2.0x at 1-2 rows,
1.45x at 4-8, 1.15-1.3x at 12-32, 1.04-1.1x from 48 to 2,048, one stream 1.51x
(docs/BENCHMARKS.md). With ``--pack-weights panel``, float32 weights, where the native kernels
build, go into column panels for ``panel_linear`` (:mod:`pagedserve.kernels`, ``panel_gemm.cpp``):
on an AVX2-only CPU it beats oneDNN's float32 path at every row count a step has (measured on ``small``'s shapes, one thread,
AMD EPYC under load: 1.3-2.3x for one row, 0.8-1.35x for 8 rows — faster on the large matrices, which
dominate — and 1.1-1.3x for 295-row prompt chunks). Everything else (bfloat16 on a CPU with neither,
or no native build) is packed for oneDNN, the CPU matmul library under torch, as follows.

``F.linear`` on CPU re-lays out the weight matrix into oneDNN's blocked format on every call; a
weight packed at load skips that. The gain is largest where a step is small, which is decode
(measured on ``small``'s shapes, one thread, bf16: 1.5-2.2x for one row, 1.2-1.35x for 36 rows,
~1.05x for 300-row prompt chunks), and results are bit-identical in bf16. This is the packing
torch's own compiler (inductor with freezing) applies to CPU linears; here it is done without
compiling anything.

Only plain ``nn.Linear`` layers in float32 or bfloat16 on a CPU are packed. A tied LM head is not
(:mod:`~pagedserve.models.replace`: SmolLM2 dequantized to bf16 held 54 MiB more).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedserve.models.replace import replace_linears

logger = logging.getLogger(__name__)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build can prepack linear weights of ``dtype`` on ``device``."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PrepackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` packed once at load (:meth:`pack`) and held as the buffer
    ``<BUFFER>``, not persistent: a state dict keeps the checkpoint's layout, not the kernel's (and
    an opaque oneDNN tensor cannot be saved or copied like a plain one)."""

    BUFFER: str

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops=None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_nbytes = weight.nbytes  # the weight's own elements, reordered (panels' padding: under 16 columns)
        self.ops = ops
        self.register_buffer(self.BUFFER, self.pack(weight.detach()), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedLinear(PrepackedLinear):
    """``W`` held in oneDNN's packed layout (an opaque tensor)."""

    BUFFER = "packed_weight"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


class NativeLinear(PrepackedLinear):
    """Through a native kernel, ``W`` packed by ``ops.<PACK>``; ``ops.<KERNEL>(y, rows, packed, bias)``
    writes ``y [rows, out]`` from unit-stride ``rows [rows, in]``. Each packing names the two and
    its ``BUFFER``."""

    PACK: str
    KERNEL: str

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return getattr(self.ops, self.PACK)(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1 or rows.stride(0) < self.in_features:
            rows = rows.contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        getattr(self.ops, self.KERNEL)(y, rows, getattr(self, self.BUFFER), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class PanelLinear(NativeLinear):
    """float32 through the native ``panel_linear`` kernel, ``W`` held as ``[ceil(N / 16), K, 16]``
    column panels (zero-padded past ``N``)."""

    PACK, KERNEL, BUFFER = "panel_pack", "panel_linear", "panels"


class TileLinear(NativeLinear):
    """bfloat16 through the native ``tile_linear`` kernel (AMX-BF16 tiles, or AVX512-BF16's
    ``vdpbf16ps`` over the same bytes read as 16-feature columns), ``W`` held as
    ``[out / 16, in / 32, 16, 32]``, each 32 inputs of 16 outputs one tile in the instruction's
    pair order."""

    PACK, KERNEL, BUFFER = "tile_pack", "tile_linear", "tiles"


def _use_tiles(ops, linear: nn.Linear) -> bool:
    weight, bias = linear.weight, linear.bias
    return (ops is not None and hasattr(ops, "tile_linear") and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and (bias is None or bias.dtype == torch.bfloat16) and bool(ops.tile_linear_usable()))


def _use_panels(ops, linear: nn.Linear) -> bool:
    return (ops is not None and hasattr(ops, "panel_linear") and linear.weight.dtype == torch.float32
            and linear.weight.device.type == "cpu")


def pack_linears(model: nn.Module, ops=None, layout: str = "auto") -> int:
    """Replace every float ``nn.Linear`` of ``model`` in place, where this machine can, by a
    :class:`TileLinear` (bfloat16 on AMX-BF16 or AVX512-BF16, with the native kernels ``ops``;
    ``layout`` ``auto``),
    a :class:`PanelLinear` (float32, with ``ops``; ``layout`` ``panel``) or a :class:`PackedLinear`
    (oneDNN: everything else, and everything with ``layout`` ``onednn``); returns how many."""
    tile_ops = ops if layout == "auto" else None
    panel_ops = ops if layout == "panel" else None

    def make(linear: nn.Linear) -> nn.Module:
        if _use_tiles(tile_ops, linear):
            return TileLinear(linear.weight, linear.bias, tile_ops)
        if _use_panels(panel_ops, linear):
            return PanelLinear(linear.weight, linear.bias, panel_ops)
        return PackedLinear.from_linear(linear)

    def accept(linear: nn.Linear) -> bool:
        return (_use_tiles(tile_ops, linear) or _use_panels(panel_ops, linear)
                or can_pack(linear.weight.dtype, linear.weight.device))

    packed = replace_linears(model, make, accept, tied_head=False)
    if packed:
        tiles = sum(isinstance(m, TileLinear) for m in model.modules())
        panels = sum(isinstance(m, PanelLinear) for m in model.modules())
        path = tile_ops.tile_linear_path() if tiles else "none"
        logger.info("prepacked %d linear layers (%d in the tile layout for the native kernel's %s path and %d as "
                    "float32 panels for the native kernels, %d for oneDNN)", packed, tiles, path, panels,
                    packed - tiles - panels)
    return packed
