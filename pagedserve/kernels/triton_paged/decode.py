"""Paged decode attention: one query token per sequence against its whole cached context.

Grid ``(sequences, kv_heads, splits)``. A program takes one sequence, one KV head and one
partition of ``PARTITION`` context positions, and computes all the query heads that share that
KV head together (the rows of one ``tl.dot``, padded to 16): each K and V vector is read once per
KV head, not once per query head, which is what GQA saves in a bandwidth-bound step. Tiles of
``BLOCK_N`` positions go through an online softmax (running max and sum, base 2).

Split-K: a batch of one 2,000-token sequence on a 14-head model is 2 KV-head programs, too few to
load a GPU's memory system; cutting the context into partitions gives ``splits`` times more
programs. With one partition the program writes the output directly; otherwise each writes its
normalised partial output and log-sum-exp, and :func:`_merge_kernel` combines the partitions a
sequence really has (``ceil(context / PARTITION)``). The split count comes from the block table's
width, never from the context lengths on the device, so choosing it costs no host sync and a
CUDA graph (whose tables have a fixed width) keeps one grid for every step it replays.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_paged.paged_tiles import block_d, dot_precision, load_scales, load_tile, tile_offsets
from pagedserve.kernels.triton_paged.pools import PoolView

PARTITION = 512  # context positions per split-K program
BLOCK_N = 64  # positions per tile: 16 KiB of bf16 K per tile at head_dim 128
MIN_DOT_ROWS = 16  # tl.dot's smallest M: a query group of 1..16 heads is padded to 16 rows


@triton.jit
def _decode_kernel(q_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_ptr, ctx_ptr,
                   stride_qs, stride_qh, stride_os, stride_oh, stride_table,
                   block_stride, slot_stride, head_stride, scale_block_stride, scale_slot_stride, scale_head_stride,
                   scale_log2,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   FMT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * PARTITION
    end = tl.minimum(ctx, start + PARTITION)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block, offset = tile_offsets(table_row, offs_n, n_mask, BLOCK_SIZE)
        k = load_tile(k_ptr, block, offset, n_mask, kv_head, d, d_mask, block_stride, slot_stride, head_stride,
                      FMT).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if FMT != "float":
            s = s * load_scales(k_scale_ptr, block, offset, n_mask, kv_head, scale_block_stride, scale_slot_stride,
                                scale_head_stride)[None, :]
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile the loop visits has a valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_ptr, block, offset, n_mask, kv_head, d, d_mask, block_stride, slot_stride, head_stride,
                      FMT).to(q.dtype)
        if FMT != "float":
            p = p * load_scales(v_scale_ptr, block, offset, n_mask, kv_head, scale_block_stride, scale_slot_stride,
                                scale_head_stride)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A partition past the context (or a padding row, context 0) saw nothing: output 0, weight 0.
    seen = l_i > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        row = (seq.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + row, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")),
                 mask=g_mask)


@triton.jit
def _merge_kernel(out_ptr, part_out_ptr, part_lse_ptr, ctx_ptr, stride_os, stride_oh,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PARTITION: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(ctx_ptr + seq), PARTITION)  # partitions this sequence's context fills
    sp = tl.arange(0, BLOCK_S)
    s_mask = (sp < used) & (sp < NUM_SPLITS)
    row = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # context 0: every weight is 0
    w = tl.where(s_mask, tl.exp2(lse - top), 0.0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def num_splits(table_width: int, block_size: int, partition: int = PARTITION) -> int:
    """Split-K partitions for block tables ``table_width`` blocks wide (the longest context they hold)."""
    return max(1, -(-table_width * block_size // partition))


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_pool: PoolView, v_pool: PoolView,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 partition: int = PARTITION, block_n: int = BLOCK_N) -> torch.Tensor:
    """Attention of ``q`` (``[S, heads, head_dim]``, one token per sequence) over each sequence's
    first ``context_lens[i]`` cached positions, read through ``block_tables`` (``[S, width]``);
    written into ``out`` (same shape as ``q``, any dtype) and returned.

    ``partition`` must be a multiple of ``block_n``; tests lower both to reach several tiles and
    partitions with short contexts."""
    seqs, heads, head_dim = q.shape
    if seqs == 0:
        return out
    if partition % block_n:
        raise ValueError(f"partition ({partition}) must be a multiple of block_n ({block_n})")
    kv_heads = k_pool.num_kv_heads
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    group = heads // kv_heads
    splits = num_splits(block_tables.shape[1], k_pool.block_size, partition)
    bd = block_d(head_dim)
    if splits > 1:
        part_out = torch.empty(seqs, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(seqs, heads, splits, dtype=torch.float32, device=q.device)
    else:  # unused: the programs write the output directly
        part_out = part_lse = out
    p = k_pool
    _decode_kernel[(seqs, kv_heads, splits)](
        q, out, part_out, part_lse, p.data, v_pool.data, p.scales_or_data, v_pool.scales_or_data,
        block_tables, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        p.block_stride, p.slot_stride, p.head_stride, *p.scale_strides,
        scale * math.log2(math.e),
        NUM_HEADS=heads, GROUP=group, BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_SIZE=p.block_size, BLOCK_N=block_n, PARTITION=partition,
        NUM_SPLITS=splits, FMT=p.fmt, DOT_PRECISION=dot_precision(q.dtype))
    if splits > 1:
        _merge_kernel[(seqs, heads)](
            out, part_out, part_lse, context_lens, out.stride(0), out.stride(1),
            NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=bd, PARTITION=partition, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits))
    return out
