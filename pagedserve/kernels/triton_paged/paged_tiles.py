"""Reading a tile of K or V vectors through a block table: the one piece the decode and prefill
kernels share.

A tile is ``BLOCK_N`` consecutive positions of one sequence and one KV head. Position ``n`` lives
in block ``table[n // block_size]`` at offset ``n % block_size``, so a tile may span several
blocks (or part of one) and its width is independent of the block size. Quantized pools return
the stored integers (or fp8 values) converted to the compute dtype, and their scales separately:
the kernels apply a K scale to each score and a V scale to each softmax weight, once per token,
instead of scaling ``head_dim`` values.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_offsets(table_row_ptr, offs_n, n_mask, BLOCK_SIZE: tl.constexpr):
    """(block id, offset in block) of each position of a tile; masked positions read block 0."""
    block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return block, offs_n % BLOCK_SIZE


@triton.jit
def load_tile(cache_ptr, block, offset, n_mask, head, d, d_mask, block_stride, slot_stride, head_stride,
              FMT: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` stored values as stored (fp8 bytes read as e4m3; quantized values not yet
    scaled; masked entries 0): the caller converts them to its compute dtype."""
    ptrs = cache_ptr + (block * block_stride + offset * slot_stride + head * head_stride)[:, None] + d[None, :]
    raw = tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0)
    if FMT == "fp8":
        return raw.to(tl.float8e4nv, bitcast=True)
    return raw


@triton.jit
def load_scales(scale_ptr, block, offset, n_mask, head, scale_block_stride, scale_slot_stride,
                scale_head_stride):
    """``[BLOCK_N]`` float32 scales of a quantized tile (masked entries 0)."""
    ptrs = scale_ptr + block * scale_block_stride + offset * scale_slot_stride + head * scale_head_stride
    return tl.load(ptrs, mask=n_mask, other=0.0).to(tl.float32)


def dot_precision(dtype) -> str:
    """``tl.dot``'s input precision for a compute dtype: float32 inputs multiply as float32 ("ieee"),
    so the kernels match a float32 reference (TF32 would keep 10 mantissa bits); 16-bit inputs are
    exact in the tensor cores either way and take Triton's default."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """The tile width over head_dim: a power of two, at least 16 (``tl.dot``'s smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))
