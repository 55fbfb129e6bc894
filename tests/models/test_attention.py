"""Every fast attention backend against the plain-torch reference, on the same paged inputs."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.kernels import kernel_error, native_ops, paged_decode_kernel, paged_decode_quantized_kernel
from pagedserve.kv.cache import HeadMajorKVCache
from pagedserve.kv.quant import QuantizedKVCache, dequantize_kv
from pagedserve.models.attention import (ATTENTION_BACKENDS, FUSED_DECODE_MAX_GROUP, AttentionMetadata,
                                         fused_attention, reference_attention, write_kv)

# Both decode entry points live in the one native library: built, or neither is.
needs_kernels = pytest.mark.skipif(paged_decode_kernel() is None, reason=f"native kernel unavailable: {kernel_error()}")


def _paged_batch(decode_ctx, prefills, block_size=4, kvh=2, heads=6, hd=8, dtype=torch.float32, seed=0):
    """Random caches and a batch of decodes (context lengths) and prompt chunks (q_len, ctx_len)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 96
    k_cache = torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, hd, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    tables = []
    for ctx in list(decode_ctx) + [c for _, c in prefills]:
        n = -(-ctx // block_size)
        tables.append(torch.tensor([perm.pop() for _ in range(n)]))
    d = len(decode_ctx)
    width = max(len(t) for t in tables[:d]) if d else 0
    dt = torch.zeros(d, width, dtype=torch.long)
    for i in range(d):
        dt[i, :len(tables[i])] = tables[i]
    ctx = torch.tensor(decode_ctx, dtype=torch.long)
    mask = (torch.arange(width * block_size)[None] < ctx[:, None])[:, None, None, :] if d else None
    pre, start = [], d
    for (q_len, c), table in zip(prefills, tables[d:]):
        pre.append((start, q_len, c, table))
        start += q_len
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), d, dt, ctx, mask, pre)
    q = torch.randn(start, heads, hd, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("backend", sorted(set(ATTENTION_BACKENDS) - {"reference"}))
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_backend_matches_reference(backend, dtype, atol):
    q, k, v, meta = _paged_batch([1, 5, 17, 33], [(7, 7), (5, 30), (1, 9)], dtype=dtype)
    want = reference_attention(q, k, v, meta, 0.3)
    got = ATTENTION_BACKENDS[backend](q, k, v, meta, 0.3)
    assert torch.allclose(got.float(), want.float(), atol=atol)


def test_reference_matches_dense_causal_attention():
    """One contiguous prompt: the paged reference equals plain causal attention."""
    q, k, v, meta = _paged_batch([], [(12, 12)], kvh=2, heads=2)
    out = reference_attention(q, k, v, meta, 0.5)
    table = meta.prefills[0][3]
    kk = k[table].flatten(0, 1)[:12].transpose(0, 1)
    vv = v[table].flatten(0, 1)[:12].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=0.5)
    assert torch.allclose(out, dense.transpose(0, 1), atol=1e-5)


def test_write_kv_puts_each_token_in_its_slot():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(9, dtype=torch.float32).view(3, 1, 3)
    slots = torch.tensor([5, 0, 6])  # block 2 slot 1, block 0 slot 0, block 3 slot 0
    write_kv(k_cache, v_cache, k, -k, slots)
    assert torch.equal(k_cache[2, 1, 0], k[0, 0])
    assert torch.equal(k_cache[0, 0, 0], k[1, 0])
    assert torch.equal(v_cache[3, 0, 0], -k[2, 0])


def _head_major(cache: torch.Tensor) -> HeadMajorKVCache:
    """The same blocks as an engine pool (stored ``[kv_heads, blocks, block_size, head_dim]``)."""
    nb, bs, kvh, hd = cache.shape
    pool = HeadMajorKVCache(nb, bs, kvh, hd, cache.dtype, torch.device("cpu"))
    pool.data.copy_(cache.permute(2, 0, 1, 3))
    return pool


def test_native_kernel_builds_here():
    """The fused backend is the CPU default: on a machine with a compiler it must actually build
    (set PAGEDSERVE_KERNELS=0 to run the suite without it, which this test then reports)."""
    if os.environ.get("PAGEDSERVE_KERNELS") == "0":
        pytest.skip("native kernels disabled by PAGEDSERVE_KERNELS=0")
    assert paged_decode_kernel() is not None, kernel_error()


# head_dim 64 and 128 take the kernel's register-blocked path; 8 and 24 its generic loops.
@needs_kernels
@pytest.mark.parametrize("heads,kvh,hd", [(6, 2, 8), (4, 4, 24), (12, 4, 64), (8, 1, 64), (16, 2, 128)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_fused_kernel_matches_reference_on_engine_pools(heads, kvh, hd, dtype, atol):
    ctx = [1, 5, 16, 17, 33, 100, 250]
    q, k, v, meta = _paged_batch(ctx, [(7, 7), (5, 30)], block_size=16, kvh=kvh, heads=heads, hd=hd, dtype=dtype)
    k_pool, v_pool = _head_major(k), _head_major(v)
    want = reference_attention(q, k, v, meta, hd ** -0.5)
    got = fused_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    # and the decodes really went through the kernel, not the matmul fallback
    direct = torch.empty_like(q[:len(ctx)])
    paged_decode_kernel()(direct, q[:len(ctx)].contiguous(), k_pool.data, v_pool.data,
                          meta.decode_block_tables.contiguous(), meta.decode_context_lens, hd ** -0.5)
    assert torch.equal(direct, got[:len(ctx)])


@needs_kernels
def test_fused_kernel_refuses_a_block_outside_the_pool():
    q, k, v, meta = _paged_batch([20], [], block_size=16, kvh=2, heads=4, hd=64)
    bad = meta.decode_block_tables.clone()
    bad[0, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_kernel()(torch.empty_like(q), q, _head_major(k).data, _head_major(v).data, bad,
                              meta.decode_context_lens, 0.1)


def _quantized(cache: torch.Tensor, kind: str) -> QuantizedKVCache:
    """The same blocks quantized into an engine pool, through its own write path."""
    nb, bs, kvh, hd = cache.shape
    pool = QuantizedKVCache.allocate(nb, bs, kvh, hd, kind, cache.dtype, torch.device("cpu"))
    pool.write(torch.arange(nb * bs), cache.flatten(0, 1))
    return pool


def _in_float32(pool: QuantizedKVCache) -> QuantizedKVCache:
    """The same stored bits and scales, dequantized to float32 when gathered."""
    return QuantizedKVCache(pool.data, pool.scales, pool.kv_cache_dtype, torch.float32, pool.head_dim)


# Quantized pools. The reference gathers and dequantizes into the model dtype, then computes in
# float32; the kernel dequantizes in float32 as it reads. float32 models: the same numbers up to
# summation order. bf16: the reference's own rounding of each K/V value to bf16 dominates their
# difference (the existing bf16 tolerance), so the kernel's decodes are also held to the float32
# reference over the same stored bits: off by their output's bf16 rounding alone (2^-8 relative).
@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("heads,kvh,hd", [(6, 2, 8), (4, 4, 24), (12, 4, 64), (8, 1, 64), (16, 2, 128)])
@pytest.mark.parametrize("dtype,atol,rtol_exact", [(torch.float32, 1e-5, 0), (torch.bfloat16, 3e-2, 2 ** -8)])
def test_fused_kernel_reads_quantized_pools_like_the_reference(kind, heads, kvh, hd, dtype, atol, rtol_exact):
    ctx = [1, 5, 16, 17, 33, 100, 250]
    d = len(ctx)
    q, k, v, meta = _paged_batch(ctx, [(7, 7), (5, 30)], block_size=16, kvh=kvh, heads=heads, hd=hd, dtype=dtype)
    k_pool, v_pool = _quantized(k, kind), _quantized(v, kind)
    want = reference_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    got = fused_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    exact = reference_attention(q.float(), _in_float32(k_pool), _in_float32(v_pool), meta, hd ** -0.5)
    assert torch.allclose(got[:d].float(), exact[:d], atol=1e-5, rtol=rtol_exact)
    # and the decodes really went through the kernel, not the matmul fallback
    direct = torch.empty_like(q[:d])
    paged_decode_quantized_kernel()(direct, q[:d].contiguous(), k_pool.data, v_pool.data, k_pool.scales,
                                    v_pool.scales, meta.decode_block_tables, meta.decode_context_lens, hd ** -0.5,
                                    kind)
    assert torch.equal(direct, got[:d])


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("hd", [64, 24])  # the AVX-512 loaders and the generic ones
def test_fused_kernel_dequantizes_every_stored_value_exactly(kind, hd):
    """A one-token context returns its value row: every stored bit pattern (fp8 subnormals, the
    int4 nibbles of both halves of a byte) times its scale, exactly as dequantize_kv gives it."""
    g = torch.Generator().manual_seed(3)
    width = hd // 2 if kind == "int4" else hd
    rows = -(-256 // width)  # one row per block, together holding all 256 byte values
    pool = QuantizedKVCache.allocate(rows, 4, 1, hd, kind, torch.float32, torch.device("cpu"))
    patterns = torch.arange(rows * width) % 256
    if kind == "fp8":
        patterns[(patterns & 0x7F) == 0x7F] = 0  # e4m3's NaN bit patterns
    pool.data[:, 0, 0] = patterns.to(torch.uint8).view(pool.data.dtype).view(rows, width)
    pool.scales[:, 0, 0] = (torch.rand(rows, generator=g) * 4 + 1e-3).half()
    pool.scales[0, 0, 0] = 1e-6  # the smallest scale quantize_kv gives, a float16 subnormal
    q = torch.randn(rows, 2, hd, generator=g)
    out = torch.empty_like(q)
    paged_decode_quantized_kernel()(out, q, pool.data, pool.data, pool.scales, pool.scales,
                                    torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.long), 0.1, kind)
    want = dequantize_kv(pool.data[:, 0, 0], pool.scales[:, 0, 0], kind, torch.float32)
    assert torch.equal(out, want.unsqueeze(1).expand(rows, 2, hd))


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_fused_backend_decodes_wider_query_groups_through_matmul(kind):
    # 16 query heads on one KV head: more than the kernel's register-held group, so the fused
    # backend must answer through the matmul path, not fail inside the step loop.
    heads = 2 * FUSED_DECODE_MAX_GROUP
    q, k, v, meta = _paged_batch([1, 17, 40], [(5, 30)], block_size=16, kvh=1, heads=heads, hd=64)
    k_pool, v_pool = (_head_major(k), _head_major(v)) if kind == "auto" else (_quantized(k, kind), _quantized(v, kind))
    want = reference_attention(q, k_pool if kind != "auto" else k, v_pool if kind != "auto" else v, meta, 0.125)
    got = fused_attention(q, k_pool, v_pool, meta, 0.125)
    assert torch.allclose(got, want, atol=1e-5)


@needs_kernels
def test_fused_kernel_refuses_mismatched_quantized_pools():
    q, k, v, meta = _paged_batch([20], [], block_size=16, kvh=2, heads=4, hd=64)
    pool = _quantized(k, "int8")
    args = (meta.decode_block_tables, meta.decode_context_lens, 0.1)
    kernel = paged_decode_quantized_kernel()
    with pytest.raises(RuntimeError, match="int4"):  # int8 bytes are not an int4 pool of this head_dim
        kernel(torch.empty_like(q), q, pool.data, pool.data, pool.scales, pool.scales, *args, "int4")
    with pytest.raises(RuntimeError, match="unknown kind"):
        kernel(torch.empty_like(q), q, pool.data, pool.data, pool.scales, pool.scales, *args, "int3")
    bad = meta.decode_block_tables.clone()
    bad[0, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(torch.empty_like(q), q, pool.data, pool.data, pool.scales, pool.scales, bad,
               meta.decode_context_lens, 0.1, "int8")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("q_len,ctx", [(1, 1), (7, 7), (5, 30), (33, 40)])
def test_native_causal_softmax_matches_masked_softmax(dtype, atol, q_len, ctx):
    ops = native_ops()
    if ops is None:
        pytest.skip(f"native kernels unavailable: {kernel_error()}")
    scores = torch.randn(3, 2, q_len, ctx).to(dtype)
    future = torch.arange(ctx)[None] > torch.arange(ctx - q_len, ctx)[:, None]
    want = scores.masked_fill(future, float("-inf")).softmax(-1)
    got = scores.clone()
    ops.causal_softmax_(got, q_len)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    assert torch.all(got[..., future] == 0)
