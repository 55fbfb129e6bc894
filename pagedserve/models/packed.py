"""Linear layers with their weights prepacked once for oneDNN, the CPU matmul library under torch.

``F.linear`` on CPU re-lays out the weight matrix into oneDNN's blocked format on every call; a
weight packed at load skips that. The gain is largest where a step is small, which is decode
(measured on ``small``'s shapes, one thread, bf16: 1.5-2.2x for one row, 1.2-1.35x for 36 rows,
~1.05x for 300-row prompt chunks), and results are bit-identical in bf16. This is the packing
torch's own compiler (inductor with freezing) applies to CPU linears; here it is done without
compiling anything.

Only plain ``nn.Linear`` layers in float32 or bfloat16 on a CPU with oneDNN are packed; quantized
twins, other devices and dtypes keep their own path. A tied LM head is not packed: its packed
copy would hold the embedding matrix a second time (SmolLM2 dequantized to bf16: 54 MiB more, 310.6
MiB logged for 256.6 MiB of weights), so its logits read the one table the lookups use.
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


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held in oneDNN's packed layout (an opaque tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_nbytes = weight.nbytes  # the packed tensor is opaque; it holds the same elements
        # Not a persistent buffer: an opaque oneDNN tensor cannot be saved or copied like a plain one.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every float ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place, where this
    machine can; returns how many were packed (0 where it can't)."""
    packed = replace_linears(model, PackedLinear.from_linear, lambda m: can_pack(m.weight.dtype, m.weight.device),
                             tied_head=False)
    if packed:
        logger.info("prepacked %d linear layers for oneDNN", packed)
    return packed
