"""One layer's K (or V) pool as the Triton kernels address it.

The engine keeps three pool layouts (``pagedserve.kv``): head-major float pools
``[kv_heads, blocks, block_size, head_dim]``, token-major quantized pools
``[blocks, block_size, kv_heads, head_dim]`` with a float16 scale per vector, and plain
token-major tensors (tests). Each is the same thing to a kernel: element ``(block, slot, head, d)``
at ``base + block·block_stride + slot·slot_stride + head·head_stride + d``, so the kernels take a
:class:`PoolView` and never branch on the layout. This module knows only tensors (the kernels sit
below ``pagedserve.kv``); the backend builds the views from the engine's pool objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Storage formats the kernels read and write; int4 pools (kv/int4.py) are not among them.
FORMATS = ("float", "int8", "fp8")
# The largest stored magnitude of each quantized format, as pagedserve.kv.quant quantizes.
QMAX = {"int8": 127.0, "fp8": 448.0}


@dataclass(frozen=True)
class PoolView:
    """Where each K (or V) vector of a pool lives, and how it is stored."""

    data: torch.Tensor
    block_stride: int
    slot_stride: int
    head_stride: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    fmt: str = "float"  # one of FORMATS: "float" stores the vectors as they are (fp32 / fp16 / bf16)
    scales: torch.Tensor | None = None  # quantized formats: one scale per (block, slot, head)
    scale_strides: tuple[int, int, int] = (0, 0, 0)  # block, slot, head

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"pool format must be one of {FORMATS}, got {self.fmt!r}")
        if (self.fmt == "float") != (self.scales is None):
            raise ValueError("quantized pools carry scales; float pools do not")
        if self.data.stride(-1) != 1:
            raise ValueError("a pool's head_dim elements must be contiguous")

    @classmethod
    def head_major(cls, data: torch.Tensor) -> PoolView:
        """A float pool stored ``[kv_heads, blocks, block_size, head_dim]``."""
        kvh, _, bs, hd = data.shape
        return cls(data, data.stride(1), data.stride(2), data.stride(0), bs, kvh, hd)

    @classmethod
    def token_major(cls, data: torch.Tensor, fmt: str = "float", scales: torch.Tensor | None = None) -> PoolView:
        """A pool stored ``[blocks, block_size, kv_heads, head_dim]``, with scales ``[blocks, block_size,
        kv_heads]`` when quantized."""
        _, bs, kvh, hd = data.shape
        strides = tuple(scales.stride()) if scales is not None else (0, 0, 0)
        return cls(data, data.stride(0), data.stride(1), data.stride(2), bs, kvh, hd, fmt, scales, strides)

    @property
    def quantized(self) -> bool:
        return self.fmt != "float"

    @property
    def scales_or_data(self) -> torch.Tensor:
        """A tensor to pass where a kernel takes the scales pointer (unused for float pools)."""
        return self.scales if self.scales is not None else self.data
