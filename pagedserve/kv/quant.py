"""KV cache quantization: quantize on write into the block, dequantize in attention — the fused
decode kernel as it reads each block in place, the other paths the blocks they gather.

Each stored K (or V) vector — one token, one KV head, ``head_dim`` values — gets its own scale
(``absmax / qmax``, kept as float16 beside the blocks), so an outlier in one head or one token
costs precision nowhere else::

    data   [num_blocks, block_size, kv_heads, head_dim]     int8 / fp8 bits
    scales [num_blocks, block_size, kv_heads]               float16

int4 has a layout of its own (:mod:`pagedserve.kv.int4`: keys per channel within a block, values
rotated per token, each sequence's open block in a float16 tail); its values use this module's
per-vector int4 rounding (:func:`quantize_kv`) and its rotation (:func:`hadamard_matrix`).

With head_dim 64 that is 66 bytes per head and token against bf16's 128 (×1.94 the seats). The
native decode kernel (``pagedserve/kernels/paged_attention_quantized.cpp``) reads the int8 and fp8
layout in place, applying each vector's scale once to its dot product and once to its softmax
weight; on CPU a step's rows are quantized and stored by one native call
(``pagedserve/kernels/kv_write.cpp``), :func:`quantize_kv` its reference. :class:`QuantizedKVCache`
stands in for the plain cache tensor wherever the engine touches one (its shape, indexing by block
ids, copy-on-write, writes by slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from pagedserve.kv.sizing import DEFAULT_BLOCK_SIZE, kv_pool_bytes_per_token
from pagedserve.kv.zeros import zeros

SCALE_DTYPE = torch.float16  # kv.sizing.SCALE_BYTES bytes each
_QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}  # largest stored magnitude; fp8 is e4m3's finite max
_MIN_SCALE = 1e-6  # an all-zero vector still gets a finite, float16-representable scale


def kv_dtype_name(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The real KV storage precision: ``auto`` resolves to the model dtype (e.g. ``bfloat16``)."""
    return str(model_dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                             model_dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The real bytes one token's K and V take across all layers, scales included: the planner's
    formula (:func:`~pagedserve.kv.sizing.kv_pool_bytes_per_token`), with ``auto`` resolved to the
    model dtype. ``kv_cache_dtype`` was checked with the engine's config (an unknown one: SizingError)."""
    return kv_pool_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype_name(kv_cache_dtype, model_dtype),
                                   block_size)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """The normalised Hadamard rotation of ``n``-value vectors, ``[n, n]``: symmetric and orthogonal,
    so it is its own inverse (``H @ H = I``).

    Sylvester's construction for the largest power of two ``b`` dividing ``n`` (64 for head_dim 64,
    32 for 96), repeated block-diagonally ``n / b`` times; entries ``±1 / sqrt(b)``. A vector whose
    energy sits in one channel of a block comes out spread evenly over the block's ``b`` channels.
    """
    block = n & -n  # the lowest set bit: the largest power of two dividing n
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*[h] * (n // block)) / math.sqrt(block)
    return h.to(dtype=dtype, device=device)


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize vectors ``[..., head_dim]`` → (stored bits ``uint8``/``int8``, float16 scales ``[...]``)."""
    qmax = _QMAX[kv_cache_dtype]
    xf = x.float()
    scales = (xf.abs().amax(dim=-1) / qmax).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)
    # Divide by the float16-rounded scale so dequantization multiplies by exactly what was used.
    y = xf / scales.float().unsqueeze(-1)
    if kv_cache_dtype == "int8":
        data = y.round().clamp(-qmax, qmax).to(torch.int8)
    elif kv_cache_dtype == "fp8":
        # Stored as raw bytes: CPU torch cannot index_copy_ float8 tensors, but can copy uint8.
        data = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    else:  # int4: values in [-7, 7] + 8 → nibbles 1..15, even element in the low nibble
        nib = (y.round().clamp(-qmax, qmax) + 8).to(torch.uint8)
        data = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return data, scales


def dequantize_kv(data: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: ``[..., head_dim]`` in ``out_dtype``."""
    if kv_cache_dtype == "int8":
        values = data.to(out_dtype)
    elif kv_cache_dtype == "fp8":
        values = data.view(torch.float8_e4m3fn).to(out_dtype)
    else:
        lo = (data & 0x0F).to(out_dtype)
        hi = (data >> 4).to(out_dtype)
        values = torch.stack([lo, hi], dim=-1).flatten(-2) - 8
    return values * scales.to(out_dtype).unsqueeze(-1)


@dataclass
class QuantizedKVCache:
    """One layer's K (or V) pool in int8 or fp8, with per-token, per-head scales; ``out_dtype``: the
    model dtype attention computes in, which :meth:`dequantize` returns."""

    data: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    scales: torch.Tensor  # [num_blocks, block_size, kv_heads] float16
    kv_cache_dtype: str
    out_dtype: torch.dtype
    head_dim: int
    # The loaded native kernels (kernels/kv_write.cpp): quantized_kv_write does write()'s work in
    # one call, the same bits; None: the torch ops (no native kernels, or another device).
    native: object | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                 out_dtype: torch.dtype, device: torch.device, native: object | None = None) -> "QuantizedKVCache":
        """An all-zero pool of ``num_blocks`` blocks, written through ``native`` where given."""
        if kv_cache_dtype not in ("int8", "fp8"):
            raise ValueError(f"a per-token quantized pool is int8 or fp8, not {kv_cache_dtype!r} "
                             "(int4: kv.int4.Int4KVCache)")
        storage = torch.int8 if kv_cache_dtype == "int8" else torch.uint8
        data = zeros((num_blocks, block_size, num_kv_heads, head_dim), storage, device)  # lazily zeroed on CPU
        scales = zeros((num_blocks, block_size, num_kv_heads), SCALE_DTYPE, device)
        return cls(data, scales, kv_cache_dtype, out_dtype, head_dim, native if device.type == "cpu" else None)

    @property
    def shape(self) -> torch.Size:
        """The logical shape, as the float cache would have it: ``[blocks, block_size, kv_heads, head_dim]``."""
        return torch.Size((*self.data.shape[:3], self.head_dim))

    @property
    def nbytes(self) -> int:
        """Bytes held, scales included."""
        return self.data.nbytes + self.scales.nbytes

    def __getitem__(self, index) -> "QuantizedKVCache":
        """The selected blocks, still quantized (``cache[block_table]`` → ``[..., block_size, kvh, hd]``)."""
        return replace(self, data=self.data[index], scales=self.scales[index])

    def __setitem__(self, index, blocks: "QuantizedKVCache") -> None:
        """Overwrite blocks with other quantized blocks, bit for bit (copy-on-write)."""
        if not isinstance(blocks, QuantizedKVCache) or blocks.kv_cache_dtype != self.kv_cache_dtype:
            raise TypeError("a quantized KV cache takes only quantized blocks of the same precision")
        self.data[index], self.scales[index] = blocks.data, blocks.scales

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x [T, kv_heads, head_dim]`` and store token i at flat slot ``slot_mapping[i]``."""
        if self.native is not None:
            rows = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads each head's values as a run
            self.native.quantized_kv_write(self.data, self.scales, slot_mapping, rows, self.kv_cache_dtype)
            return
        data, scales = quantize_kv(x, self.kv_cache_dtype)
        self.data.view(-1, *self.data.shape[2:]).index_copy_(0, slot_mapping, data)
        self.scales.view(-1, self.scales.shape[2]).index_copy_(0, slot_mapping, scales)

    def dequantize(self) -> torch.Tensor:
        """The held blocks as ``out_dtype`` values, shape :attr:`shape`."""
        return dequantize_kv(self.data, self.scales, self.kv_cache_dtype, self.out_dtype)


def gather_blocks(cache, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` as values attention can use: quantized pools (int8, fp8, int4) are
    dequantized here."""
    blocks = cache[block_ids]
    return blocks if isinstance(blocks, torch.Tensor) else blocks.dequantize()
