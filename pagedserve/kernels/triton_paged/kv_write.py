"""Store a step's new K and V vectors into their pool slots (``slot = block · block_size + offset``).

One program per ``BLOCK_T`` tokens and KV head writes those tokens' K and V vectors. Quantized pools get each
vector's scale computed and applied here, the same arithmetic as
:func:`pagedserve.kv.quant.quantize_kv` (absmax / qmax, floored at 1e-6, rounded to float16, the
vector divided by the rounded scale; int8 rounds half to even), so the torch write path and this
one store the same bits. A negative slot is skipped: a CUDA graph's padding rows write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_paged.pools import QMAX, PoolView

# float32 values below 2**22 in magnitude round to the nearest integer, ties to even, when this is
# added and taken away again: Triton's interpreter has no libdevice rint, and this is exact IEEE
# arithmetic on the GPU as well.
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 · 2**23
BLOCK_T = 16  # tokens per program: a prompt chunk's write is a few programs, a decode batch's one or two


@triton.jit
def _store_vectors(x, cache_ptr, scale_ptr, cache_off, scale_off, mask, valid,
                   FMT: tl.constexpr, QMAX: tl.constexpr):
    """Store ``[BLOCK_T, BLOCK_D]`` vectors (one per row), quantizing each row with its own scale."""
    if FMT == "float":
        tl.store(cache_ptr + cache_off, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        xf = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(xf), axis=1) / QMAX, 1e-6).to(tl.float16)
        y = xf / scale.to(tl.float32)[:, None]
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if FMT == "int8":
            stored = ((y + _ROUND_MAGIC) - _ROUND_MAGIC).to(tl.int8)
        else:  # fp8 e4m3, kept as raw bytes (uint8) in the pool
            stored = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(cache_ptr + cache_off, stored, mask=mask)
        tl.store(scale_ptr + scale_off, scale, mask=valid)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, num_tokens,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     block_stride, slot_stride, head_stride,
                     scale_block_stride, scale_slot_stride, scale_head_stride,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_T: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    valid = slot >= 0  # padding rows (and the tile's rows past the batch) store nothing
    slot = tl.maximum(slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    cache_off = (block * block_stride + offset * slot_stride + head * head_stride)[:, None] + d[None, :]
    scale_off = block * scale_block_stride + offset * scale_slot_stride + head * scale_head_stride
    rows = tokens.to(tl.int64)
    k = tl.load(k_ptr + (rows * stride_kt + head * stride_kh)[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + (rows * stride_vt + head * stride_vh)[:, None] + d[None, :], mask=mask, other=0.0)
    _store_vectors(k, k_cache_ptr, k_scale_ptr, cache_off, scale_off, mask, valid, FMT, QMAX)
    _store_vectors(v, v_cache_ptr, v_scale_ptr, cache_off, scale_off, mask, valid, FMT, QMAX)


def write_kv(k_pool: PoolView, v_pool: PoolView, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k`` and ``v`` (``[T, kv_heads, head_dim]``) at ``slot_mapping`` (``[T]``; negative = skip).

    K and V pools must share a layout and format (the engine allocates them in pairs)."""
    if (k_pool.block_stride, k_pool.slot_stride, k_pool.head_stride, k_pool.fmt) != \
            (v_pool.block_stride, v_pool.slot_stride, v_pool.head_stride, v_pool.fmt):
        raise ValueError("K and V pools must share one layout and format")
    tokens = k.shape[0]
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need contiguous head_dim elements")
    p = k_pool
    _write_kv_kernel[(triton.cdiv(tokens, BLOCK_T), p.num_kv_heads)](
        k, v, slot_mapping, p.data, v_pool.data, p.scales_or_data, v_pool.scales_or_data, tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        p.block_stride, p.slot_stride, p.head_stride, *p.scale_strides,
        BLOCK_SIZE=p.block_size, HEAD_DIM=p.head_dim, BLOCK_D=triton.next_power_of_2(p.head_dim), BLOCK_T=BLOCK_T,
        FMT=p.fmt, QMAX=QMAX.get(p.fmt, 0.0))
