"""Paged prefill attention: prompt chunks of any length against their cached context.

A chunk of ``q_len`` queries sits at the end of its sequence's ``ctx_len`` cached positions (its
own K and V are written before attention): query ``i`` is at position ``ctx_len - q_len + i`` and
sees every position up to itself. A prefix-cache hit or an earlier chunk is just ``ctx_len >
q_len``, so whole prompts, later chunks and prompts resumed after a hit are one code path.

Grid ``(chunks, row tiles, kv_heads)``. The rows of a tile are (query token, query head of the
KV head's group) pairs, ``BLOCK_M`` of them, so the heads that share K and V share each loaded
tile (GQA) and a chunk's rows are ``q_len × group`` whatever the group. A tile visits context
tiles only up to its last query's position; tiles past a chunk's rows (the grid is sized for the
longest chunk) visit none and store nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_paged.paged_tiles import block_d, dot_precision, load_scales, load_tile, tile_offsets
from pagedserve.kernels.triton_paged.pools import PoolView

BLOCK_M = 64  # (query, head) rows per program
BLOCK_N = 64  # context positions per tile


@triton.jit
def _prefill_kernel(q_ptr, out_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
                    table_ptr, q_start_ptr, q_len_ptr, ctx_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                    block_stride, slot_stride, head_stride, scale_block_stride, scale_slot_stride, scale_head_stride,
                    scale_log2,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(q_start_ptr + chunk)
    q_len = tl.load(q_len_ptr + chunk)
    ctx = tl.load(ctx_ptr + chunk)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len * GROUP
    token = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    pos = ctx - q_len + token  # each row's absolute position
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_off = (q_start + token).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    # The last query of this tile sees up to its own position; a tile with no rows sees nothing.
    last_token = tl.minimum(q_len, (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    kv_end = tl.where(tile * BLOCK_M < q_len * GROUP, ctx - q_len + last_token, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = table_ptr + chunk.to(tl.int64) * stride_table
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block, offset = tile_offsets(table_row, offs_n, n_mask, BLOCK_SIZE)
        k = load_tile(k_ptr, block, offset, n_mask, kv_head, d, d_mask, block_stride, slot_stride, head_stride,
                      FMT).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if FMT != "float":
            s = s * load_scales(k_scale_ptr, block, offset, n_mask, kv_head, scale_block_stride, scale_slot_stride,
                                scale_head_stride)[None, :]
        visible = n_mask[None, :] & (offs_n[None, :] <= pos[:, None]) & row_mask[:, None]
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen nothing yet (padding rows; a later query's first tile is never empty)
        # keep a finite reference so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_ptr, block, offset, n_mask, kv_head, d, d_mask, block_stride, slot_stride, head_stride,
                      FMT).to(q.dtype)
        if FMT != "float":
            p = p * load_scales(v_scale_ptr, block, offset, n_mask, kv_head, scale_block_stride, scale_slot_stride,
                                scale_head_stride)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + token).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill(out: torch.Tensor, q: torch.Tensor, k_pool: PoolView, v_pool: PoolView,
                  block_tables: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                  context_lens: torch.Tensor, max_query_len: int, scale: float,
                  block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> torch.Tensor:
    """Attention of each prompt chunk ``c``: ``q[query_starts[c] : + query_lens[c]]`` (rows of the
    flat batch ``q``, ``[T, heads, head_dim]``) over its first ``context_lens[c]`` cached positions,
    read through ``block_tables[c]``; written into the same rows of ``out`` and returned.

    ``max_query_len`` (a host integer: the caller knows it without a sync) sizes the grid."""
    chunks = query_starts.shape[0]
    if chunks == 0 or max_query_len == 0:
        return out
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.num_kv_heads
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    group = heads // kv_heads
    p = k_pool
    grid = (chunks, triton.cdiv(max_query_len * group, block_m), kv_heads)
    _prefill_kernel[grid](
        q, out, p.data, v_pool.data, p.scales_or_data, v_pool.scales_or_data,
        block_tables, query_starts, query_lens, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        p.block_stride, p.slot_stride, p.head_stride, *p.scale_strides,
        scale * math.log2(math.e),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_SIZE=p.block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, FMT=p.fmt, DOT_PRECISION=dot_precision(q.dtype))
    return out
