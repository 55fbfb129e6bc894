"""The Triton decode and prefill kernels against the plain-torch reference attention, over random
(scattered) block tables: GQA ratios 1-8, head dims 64 and 128, block sizes 16 and 32, contexts
1-2,048, prefix hits and chunk boundaries, float pools and int8 / fp8 pools.

Under Triton's interpreter every program runs in numpy (float16 matmuls without BLAS: slow, so the
float16 cases are the small ones), so each case is a few sequences with one or two KV heads, chosen
so that together they reach every boundary: contexts at, below and above a tile (64), a partition
(split-K) and a block; query groups padded to 16 rows (1, 3, 5, 8); chunks shorter than, equal to
and crossing a row tile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.triton_paged.decode import paged_decode  # noqa: E402
from pagedserve.kernels.triton_paged.prefill import paged_prefill  # noqa: E402
from pagedserve.models.attention import reference_attention  # noqa: E402
from pagedserve.models.triton_attention import pool_view  # noqa: E402
from tests.gpu.conftest import gpu_only  # noqa: E402
from tests.helpers.paged_inputs import head_major, in_float32, paged_batch, quantized  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _batch(decode_ctx, prefills, group, kvh, hd, bs, dtype, device, seed=0):
    blocks = sum(-(-c // bs) for c in list(decode_ctx) + [c for _, c in prefills]) + 8
    q, k, v, meta = paged_batch(decode_ctx, prefills, block_size=bs, kvh=kvh, heads=kvh * group, hd=hd,
                                dtype=dtype, seed=seed, num_blocks=blocks)
    return q, k, v, meta


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


# (query heads per KV head, KV heads, head_dim, block size, decode contexts, split-K partition, dtype)
DECODE_CASES = [
    (1, 2, 64, 16, [1, 16, 17, 130], 64, torch.float32),  # one block, block edge, three partitions
    (8, 1, 128, 32, [2048, 1, 700], 512, torch.float16),  # longest context, four partitions
    (3, 2, 64, 16, [63, 64, 65, 511], 128, torch.float32),  # a group that is no power of two; tile edges
    (5, 1, 128, 16, [77, 512], 512, torch.float16),  # exactly one partition: no merge pass
]


@pytest.mark.parametrize("group,kvh,hd,bs,contexts,partition,dtype", DECODE_CASES)
def test_decode_matches_reference(group, kvh, hd, bs, contexts, partition, dtype, device):
    q, k, v, meta = _batch(contexts, [], group, kvh, hd, bs, dtype, device)
    want = reference_attention(q, k, v, meta, hd ** -0.5)
    q, tables, lens = _to(device, q, meta.decode_block_tables, meta.decode_context_lens)
    out = torch.full_like(q, float("nan"))
    paged_decode(out, q, pool_view(_head_major_on(k, device)),
                 pool_view(_head_major_on(v, device)), tables, lens, hd ** -0.5, partition=partition)
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def _head_major_on(cache, device):
    pool = head_major(cache)
    pool.data = pool.data.to(device)
    return pool


# (group, KV heads, head_dim, block size, chunks as (query len, context len), dtype)
PREFILL_CASES = [
    (1, 2, 64, 16, [(7, 7), (40, 40), (1, 9), (16, 16)], torch.float32),  # whole prompts, a one-token chunk
    (8, 1, 128, 32, [(12, 1030), (9, 9)], torch.float32),  # a prefix hit: 1,000 cached positions
    (3, 2, 64, 16, [(17, 33), (20, 2048), (22, 22)], torch.float32),  # chunks after earlier chunks
    (4, 1, 64, 32, [(16, 48), (33, 33)], torch.float16),  # rows crossing a 64-row tile
]


@pytest.mark.parametrize("group,kvh,hd,bs,chunks,dtype", PREFILL_CASES)
def test_prefill_matches_reference(group, kvh, hd, bs, chunks, dtype, device):
    q, k, v, meta = _batch([], chunks, group, kvh, hd, bs, dtype, device, seed=1)
    want = reference_attention(q, k, v, meta, hd ** -0.5)
    t = meta.prefill_tensors
    out = torch.full_like(q, float("nan")).to(device)
    paged_prefill(out, q.to(device), pool_view(_head_major_on(k, device)), pool_view(_head_major_on(v, device)),
                  *_to(device, t.block_tables, t.query_starts, t.query_lens, t.context_lens), t.max_query_len,
                  hd ** -0.5)
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


def _quantized_on(cache, kind, device):
    pool = in_float32(quantized(cache, kind))
    pool.data, pool.scales = pool.data.to(device), pool.scales.to(device)
    return pool


def _check_quantized(kind, dtype, device):
    """Decodes and chunks over the same quantized pools; the reference dequantizes what it gathers."""
    q, k, v, meta = _batch([1, 100, 300], [(20, 20), (5, 150)], 2, 2, 64, 16, torch.float32, device)
    k_pool, v_pool = _quantized_on(k, kind, device), _quantized_on(v, kind, device)
    want = reference_attention(q, k_pool, v_pool, meta, 0.125)
    q = q.to(dtype).to(device)
    d = meta.num_decodes
    out = torch.full_like(q, float("nan"))
    paged_decode(out[:d], q[:d], pool_view(k_pool), pool_view(v_pool),
                 *_to(device, meta.decode_block_tables, meta.decode_context_lens), 0.125, partition=128)
    t = meta.prefill_tensors
    paged_prefill(out, q, pool_view(k_pool), pool_view(v_pool),
                  *_to(device, t.block_tables, t.query_starts, t.query_lens, t.context_lens), t.max_query_len, 0.125)
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_pools_match_reference(kind, device):
    """The pools are written by the torch path: reading fp8 is right in the interpreter, writing it
    (float32 → e4m3 rounding) only on a GPU (test_triton_kv_write.py)."""
    _check_quantized(kind, torch.float32, device)


@gpu_only
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_pools_in_bf16_match_reference(kind, device):
    _check_quantized(kind, torch.bfloat16, device)


@gpu_only
@pytest.mark.parametrize("group,hd,bs", [(1, 64, 16), (7, 128, 32)])
def test_bf16_matches_reference(group, hd, bs, device):
    q, k, v, meta = _batch([1, 333, 2048], [(50, 50), (30, 1030)], group, 2, hd, bs, torch.bfloat16, device)
    want = reference_attention(q, k, v, meta, 0.1)
    k_pool, v_pool = pool_view(_head_major_on(k, device)), pool_view(_head_major_on(v, device))
    q = q.to(device)
    out = torch.full_like(q, float("nan"))
    d = meta.num_decodes
    paged_decode(out[:d], q[:d], k_pool, v_pool, *_to(device, meta.decode_block_tables, meta.decode_context_lens), 0.1)
    t = meta.prefill_tensors
    paged_prefill(out, q, k_pool, v_pool, *_to(device, t.block_tables, t.query_starts, t.query_lens, t.context_lens),
                  t.max_query_len, 0.1)
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=TOLERANCE[torch.bfloat16], rtol=0)
