"""The native paged-decode kernels (pagedserve/kernels) against the plain-torch reference: every
GQA shape and dtype, quantized pools bit for bit, and the checks that keep a bad table out."""

from __future__ import annotations


import pytest
import torch

from pagedserve.kernels import kernel_error, paged_decode_kernel, paged_decode_quantized_kernel
from pagedserve.kv.quant import QuantizedKVCache, dequantize_kv
from pagedserve.models.attention import fused_attention, reference_attention
from tests.helpers.paged_inputs import head_major, in_float32, paged_batch, quantized

# Both decode entry points live in the one native library: built, or neither is.
needs_kernels = pytest.mark.skipif(paged_decode_kernel() is None, reason=f"native kernel unavailable: {kernel_error()}")


def test_native_kernel_builds_here():
    """The fused backend is the CPU default: on a machine with a compiler it must actually build."""
    assert paged_decode_kernel() is not None, kernel_error()


# head_dim 64 and 128 take the kernel's register-blocked path; 8 and 24 its generic loops.
@needs_kernels
@pytest.mark.parametrize("heads,kvh,hd", [(6, 2, 8), (4, 4, 24), (12, 4, 64), (8, 1, 64), (16, 2, 128)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_fused_kernel_matches_reference_on_engine_pools(heads, kvh, hd, dtype, atol):
    ctx = [1, 5, 16, 17, 33, 100, 250]
    q, k, v, meta = paged_batch(ctx, [(7, 7), (5, 30)], block_size=16, kvh=kvh, heads=heads, hd=hd, dtype=dtype)
    k_pool, v_pool = head_major(k), head_major(v)
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
    q, k, v, meta = paged_batch([20], [], block_size=16, kvh=2, heads=4, hd=64)
    bad = meta.decode_block_tables.clone()
    bad[0, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_kernel()(torch.empty_like(q), q, head_major(k).data, head_major(v).data, bad,
                              meta.decode_context_lens, 0.1)


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
    q, k, v, meta = paged_batch(ctx, [(7, 7), (5, 30)], block_size=16, kvh=kvh, heads=heads, hd=hd, dtype=dtype)
    k_pool, v_pool = quantized(k, kind), quantized(v, kind)
    want = reference_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    got = fused_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    exact = reference_attention(q.float(), in_float32(k_pool), in_float32(v_pool), meta, hd ** -0.5)
    assert torch.allclose(got[:d].float(), exact[:d], atol=1e-5, rtol=rtol_exact)
    # and the decodes really went through the kernel, not the matmul fallback (over a rotated pool,
    # with the queries rotated in and the output rotated back, as in_stored_basis does it)
    rot = k_pool.rotation
    q_in = q[:d] if rot is None else q[:d].float() @ rot
    direct = torch.empty_like(q_in)
    paged_decode_quantized_kernel()(direct, q_in.contiguous(), k_pool.data, v_pool.data, k_pool.scales,
                                    v_pool.scales, meta.decode_block_tables, meta.decode_context_lens, hd ** -0.5,
                                    kind)
    if rot is not None:
        direct = (direct @ rot).to(dtype)
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


@needs_kernels
def test_fused_kernel_refuses_mismatched_quantized_pools():
    q, k, v, meta = paged_batch([20], [], block_size=16, kvh=2, heads=4, hd=64)
    pool = quantized(k, "int8")
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
