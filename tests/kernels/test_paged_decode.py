"""The native paged-decode kernels (pagedserve/kernels) against the plain-torch reference: every
GQA shape and dtype, quantized pools bit for bit, and the checks that keep a bad table out."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedserve.kernels import best_isa, isa_paths, kernel_error, native_ops
from pagedserve.kv.quant import QuantizedKVCache, dequantize_kv
from pagedserve.models.attention import fused_attention, reference_attention, window_view
from tests.helpers.paged_inputs import head_major, in_float32, int4_pools, mixed_key_bits, paged_batch, quantized

# Both decode entry points live in the one native library: built, or neither is.
OPS = native_ops()
needs_kernels = pytest.mark.skipif(OPS is None, reason=f"native kernel unavailable: {kernel_error()}")
decode = None if OPS is None else OPS.paged_decode_attention  # pools in the model dtype
decode_quantized = None if OPS is None else OPS.paged_decode_attention_quantized  # int8 / fp8 pools
decode_int4 = None if OPS is None else OPS.paged_decode_attention_int4


def test_native_kernel_builds_here():
    """The fused backend is the CPU default: on a machine with a compiler it must actually build."""
    assert decode is not None, kernel_error()


# head_dim 64 and 128 take the kernel's register-blocked path; 8 and 24 its generic loops.
@needs_kernels
@pytest.mark.parametrize("heads,kvh,hd", [(6, 2, 8), (4, 4, 24), (12, 4, 64), (8, 1, 64), (16, 2, 128)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_fused_kernel_matches_reference_on_engine_pools(heads, kvh, hd, dtype, atol):
    ctx = [1, 5, 16, 17, 33, 100, 128, 129, 250, 700]  # one span of 128 tokens, two, six (a split is joined)
    q, k, v, meta = paged_batch(ctx, [(7, 7), (5, 30)], block_size=16, kvh=kvh, heads=heads, hd=hd, dtype=dtype)
    k_pool, v_pool = head_major(k), head_major(v)
    want = reference_attention(q, k, v, meta, hd ** -0.5)
    got = fused_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    # and the decodes really went through the kernel, not the matmul fallback
    direct = torch.empty_like(q[:len(ctx)])
    decode(direct, q[:len(ctx)].contiguous(), k_pool.data, v_pool.data,
           meta.decode_block_tables.contiguous(), meta.decode_context_lens, hd ** -0.5)
    assert torch.equal(direct, got[:len(ctx)])


# bf16 pools with head_dim a multiple of 32 take the kernel's 32-values-a-load path (keys through
# vdpbf16ps where the CPU has AVX512-BF16, values widened even / odd); 24 and 8 its generic loops.
@needs_kernels
@pytest.mark.parametrize("heads,kvh,hd", [(12, 4, 64), (8, 1, 64), (16, 2, 128), (4, 2, 96), (6, 2, 24), (6, 2, 8)])
def test_bf16_pools_match_the_float32_reference_to_the_output_rounding(heads, kvh, hd):
    """From bf16 pools, the kernel's output is the float32 attention over the same stored values,
    rounded once to bf16: within the rounding (2^-8 relative) of the float32 reference, however its
    scores were summed; contexts within one span, several, and a ragged last block."""
    ctx = [1, 3, 16, 31, 100, 128, 129, 300, 700]
    q, k, v, meta = paged_batch(ctx, [], block_size=16, kvh=kvh, heads=heads, hd=hd, dtype=torch.bfloat16, seed=3)
    exact = reference_attention(q.float(), k.float(), v.float(), meta, hd ** -0.5)
    got = torch.empty_like(q)
    decode(got, q.contiguous(), head_major(k).data, head_major(v).data, meta.decode_block_tables.contiguous(),
           meta.decode_context_lens, hd ** -0.5)
    assert torch.allclose(got.float(), exact, atol=1e-5, rtol=2 ** -8)


@needs_kernels
def test_a_sequences_attention_does_not_depend_on_its_batch():
    """Long contexts are split into spans by their length alone: a sequence's output is the same
    bits alone or beside others."""
    ctx = [700, 5, 129, 250]
    q, k, v, meta = paged_batch(ctx, [], block_size=16, kvh=2, heads=6, hd=64)
    k_pool, v_pool, scale = head_major(k).data, head_major(v).data, 64 ** -0.5
    tables, lens = meta.decode_block_tables.contiguous(), meta.decode_context_lens
    whole = torch.empty_like(q)
    decode(whole, q.contiguous(), k_pool, v_pool, tables, lens, scale)
    for i in range(len(ctx)):
        alone = torch.empty_like(q[i:i + 1])
        decode(alone, q[i:i + 1].contiguous(), k_pool, v_pool, tables[i:i + 1].contiguous(),
               lens[i:i + 1].contiguous(), scale)
        assert torch.equal(alone, whole[i:i + 1]), ctx[i]


@needs_kernels
@pytest.mark.parametrize("window", [1, 20, 100, 512])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_kernel_attends_within_a_sliding_window(window, dtype, atol):
    """A sliding layer's view (window_view: tables from the block holding the oldest key in the
    window, decode_first inside it) read by the kernel, which skips to each window's start: the
    reference's masked attention, on contexts shorter and longer than the window, mid-block starts;
    from the model-dtype pools and from int8 / fp8 / int4 ones."""
    ctx = [1, 5, 20, 21, 33, 100, 129, 250, 700]
    q, k, v, meta = paged_batch(ctx, [], block_size=16, kvh=2, heads=6, hd=64, dtype=dtype)
    view = window_view(meta, window, 16)
    assert (view.decode_first < 16).all() and view.decode_first.max() > 0 or window >= max(ctx)
    k_pool, v_pool = head_major(k), head_major(v)
    want = reference_attention(q, k, v, view, 64 ** -0.5)
    got = fused_attention(q, k_pool, v_pool, view, 64 ** -0.5)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    direct = torch.empty_like(q)
    decode(direct, q.contiguous(), k_pool.data, v_pool.data, view.decode_block_tables,
           view.decode_context_lens, 64 ** -0.5, view.decode_first)
    assert torch.equal(direct, got)
    for kind in ("int8", "fp8"):  # and over quantized pools: the reference over the same stored values
        k_q, v_q = quantized(k, kind), quantized(v, kind)
        exact = reference_attention(q.float(), in_float32(k_q), in_float32(v_q), view, 64 ** -0.5)
        got_q = fused_attention(q, k_q, v_q, view, 64 ** -0.5)
        assert torch.allclose(got_q.float(), exact, atol=1e-5, rtol=0 if dtype == torch.float32 else 2 ** -8), kind
        decode_quantized(direct, q.contiguous(), k_q.data, v_q.data, k_q.scales, v_q.scales,
                         view.decode_block_tables, view.decode_context_lens, 64 ** -0.5, kind,
                         view.decode_first)
        assert torch.equal(direct, got_q), kind
    # and int4 pools (written as an engine writes them, read through the window's view)
    k4, v4, _ = int4_pools(k, v, meta, chunk=13)
    k4.out_dtype = v4.out_dtype = dtype
    want4 = reference_attention(q, k4, v4, view, 64 ** -0.5)
    got4 = fused_attention(q, k4, v4, view, 64 ** -0.5)
    assert torch.allclose(got4.float(), want4.float(), atol=atol)
    direct4 = torch.empty(q.shape)
    decode_int4(direct4, q.float(), k4.data, v4.data, k4.scales, k4.zero_points, k4.key_bits,
                v4.scales, k4.tail, v4.tail, k4.decode_view().tail_slots(), view.decode_block_tables,
                view.decode_context_lens, 64 ** -0.5, "auto", view.decode_first)
    assert torch.equal((direct4 @ v4.rotation).to(dtype), got4)
    bad = view.decode_first.clone()
    bad[-1] = 16  # past the table's first block
    with pytest.raises(RuntimeError, match="window's start"):
        decode(direct, q.contiguous(), k_pool.data, v_pool.data, view.decode_block_tables,
               view.decode_context_lens, 64 ** -0.5, bad)


@needs_kernels
def test_fused_kernel_refuses_a_block_outside_the_pool():
    q, k, v, meta = paged_batch([20], [], block_size=16, kvh=2, heads=4, hd=64)
    bad = meta.decode_block_tables.clone()
    bad[0, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        decode(torch.empty_like(q), q, head_major(k).data, head_major(v).data, bad,
               meta.decode_context_lens, 0.1)


# Quantized pools. The reference gathers and dequantizes into the model dtype, then computes in
# float32; the kernel dequantizes in float32 as it reads. float32 models: the same numbers up to
# summation order. bf16: the reference's own rounding of each K/V value to bf16 dominates their
# difference (the existing bf16 tolerance), so the kernel's decodes are also held to the float32
# reference over the same stored bits: off by their output's bf16 rounding alone (2^-8 relative).
@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
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
    # and the decodes really went through the kernel, not the matmul fallback
    direct = torch.empty_like(q[:d])
    decode_quantized(direct, q[:d].contiguous(), k_pool.data, v_pool.data, k_pool.scales,
                     v_pool.scales, meta.decode_block_tables, meta.decode_context_lens, hd ** -0.5,
                     kind)
    assert torch.equal(direct, got[:d])


# int4 (kv/int4.py): decodes whose context ends on a block boundary (every earlier block quantized,
# the one this decode filled still read from its tail), inside the first block (all tail), or past
# it (quantized blocks, then the open block from the tail); keys at 4 bits a channel, or at a mix
# of every width 1..8 (bit planes of each channel's own count).
@needs_kernels
@pytest.mark.parametrize("mixed", [False, True], ids=["bits4", "mixed"])
@pytest.mark.parametrize("heads,kvh,hd", [(6, 2, 8), (4, 4, 24), (12, 4, 64), (9, 3, 64), (8, 1, 64), (16, 2, 128)])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_kernel_reads_int4_blocks_and_tails_like_the_reference(heads, kvh, hd, dtype, atol, mixed):
    ctx = [1, 5, 16, 17, 32, 33, 100, 250]
    d = len(ctx)
    q, k, v, meta = paged_batch(ctx, [(7, 7), (5, 30)], block_size=16, kvh=kvh, heads=heads, hd=hd, dtype=dtype)
    k_pool, v_pool, meta = int4_pools(k, v, meta, chunk=13, key_bits=mixed_key_bits(kvh, hd) if mixed else None)
    k_pool.out_dtype = v_pool.out_dtype = dtype
    last = meta.decode_block_tables[torch.arange(d), (meta.decode_context_lens - 1) // 16]
    assert ((k_pool.tails.slot_of[last] >= 0) == torch.tensor([c % 16 != 0 for c in ctx])).all()  # as named above
    read = k_pool.decode_view().tail_slots()  # and this step's decodes read the blocks they filled from the tail
    assert (read[last] >= 0).all() and ((read >= 0).sum() > (k_pool.tails.slot_of >= 0).sum())
    want = reference_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    got = fused_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    assert torch.allclose(got.float(), want.float(), atol=atol)
    # the decodes really went through the kernel (computing in float32, the output rotated back as
    # the fast backends' _attention does), and match the float32 reference over the same bits
    direct = torch.empty(d, heads, hd)
    decode_int4(direct, q[:d].float(), k_pool.data, v_pool.data, k_pool.scales, k_pool.zero_points,
                k_pool.key_bits, v_pool.scales, k_pool.tail, v_pool.tail, read,
                meta.decode_block_tables, meta.decode_context_lens, hd ** -0.5)
    assert torch.equal((direct @ v_pool.rotation).to(dtype), got[:d])
    k_pool.out_dtype = v_pool.out_dtype = torch.float32
    exact = reference_attention(q.float(), k_pool, v_pool, meta, hd ** -0.5)
    assert torch.allclose(direct @ v_pool.rotation, exact[:d], atol=1e-5)


# Every instruction-set path of the int4 kernel (cpu_isa.h) this CPU runs: head_dim 64 and 128 take
# the SIMD paths' compile-time shapes for values and tails, 48 their run-time one, 24 the plain
# loops everywhere; keys go through each path's bit planes at block_size 16 (whatever head_dim),
# the plain bit loop at 4 (planes of 4 bits, half a byte); 4 bits a channel, or every width 1..8
# (each one a loop of its own on the SIMD paths); groups of 1-3 query heads keep more accumulators;
# contexts end mid-block at every remainder of four.
@needs_kernels
@pytest.mark.parametrize("isa", isa_paths())
@pytest.mark.parametrize("heads,kvh,hd", [(3, 3, 64), (12, 4, 64), (8, 2, 128), (8, 1, 48), (16, 2, 64), (4, 2, 24)])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("mixed", [False, True], ids=["bits4", "mixed"])
def test_every_int4_kernel_path_matches_the_scalar_path_and_the_reference(isa, heads, kvh, hd, block_size, mixed):
    ctx = [1, 2, 3, 4, 7, 16, 18, 29, 32, 45, 100, 131]
    d = len(ctx)
    q, k, v, meta = paged_batch(ctx, [], block_size=block_size, kvh=kvh, heads=heads, hd=hd,
                                num_blocks=sum(-(-c // block_size) for c in ctx) + 8)
    k_pool, v_pool, meta = int4_pools(k, v, meta, chunk=11, key_bits=mixed_key_bits(kvh, hd) if mixed else None)
    read = k_pool.decode_view().tail_slots()
    assert (read[meta.decode_block_tables[ctx.index(131)]] < 0).sum() >= 100 // block_size  # quantized blocks read

    def run(path, meta=meta):
        out = torch.empty(d, heads, hd)
        decode_int4(out, q, k_pool.data, v_pool.data, k_pool.scales, k_pool.zero_points,
                    k_pool.key_bits, v_pool.scales, k_pool.tail, v_pool.tail, read,
                    meta.decode_block_tables, meta.decode_context_lens, hd ** -0.5, path)
        return out @ v_pool.rotation

    got = run(isa)
    exact = reference_attention(q, k_pool, v_pool, meta, hd ** -0.5)
    assert torch.allclose(got, exact, atol=1e-5), isa
    assert torch.allclose(got, run("scalar"), atol=2e-6, rtol=0), isa
    assert torch.equal(run("auto"), run(best_isa()))
    # and contexts cut to end inside a quantized block (as a rollback leaves them): its first tokens only
    lens = meta.decode_context_lens
    cut = replace(meta, decode_context_lens=torch.where(lens > 2 * block_size + 5, lens - block_size - 3, lens))
    last = read[meta.decode_block_tables[torch.arange(d), (cut.decode_context_lens - 1) // block_size]]
    assert ((last < 0) & (cut.decode_context_lens % block_size != 0)).sum() >= 2
    got = run(isa, cut)
    assert torch.allclose(got, reference_attention(q, k_pool, v_pool, cut, hd ** -0.5), atol=1e-5), isa
    assert torch.allclose(got, run("scalar", cut), atol=2e-6, rtol=0), isa


@needs_kernels
def test_int4_kernel_refuses_a_tail_slot_outside_the_tails():
    q, k, v, meta = paged_batch([20], [], block_size=16, kvh=2, heads=4, hd=64)
    kp, vp, meta = int4_pools(k, v, meta)
    bad = kp.tails.slot_of.clone()
    bad[meta.decode_block_tables[0, 1]] = kp.tail.shape[0]  # a block the sequence reads (the slots of others are not read)
    with pytest.raises(RuntimeError, match="tail slot"):
        decode_int4(torch.empty_like(q), q, kp.data, vp.data, kp.scales, kp.zero_points, kp.key_bits,
                    vp.scales, kp.tail, vp.tail, bad, meta.decode_block_tables,
                    meta.decode_context_lens, 0.1)
    with pytest.raises(RuntimeError, match="key steps"):  # K's per-channel steps are not V's per-token scales
        decode_int4(torch.empty_like(q), q, kp.data, vp.data, vp.scales, kp.zero_points, kp.key_bits,
                    vp.scales, kp.tail, vp.tail, kp.tails.slot_of, meta.decode_block_tables,
                    meta.decode_context_lens, 0.1)
    with pytest.raises(RuntimeError, match="key pool"):  # the keys are bit planes, not V's rows of nibbles
        decode_int4(torch.empty_like(q), q, vp.data, vp.data, kp.scales, kp.zero_points, kp.key_bits,
                    vp.scales, kp.tail, vp.tail, kp.tails.slot_of, meta.decode_block_tables,
                    meta.decode_context_lens, 0.1)


# Key bits the planes cannot be read by: another dtype or shape, a channel of 0 or 9 bits, a head
# whose bits do not total 4 * head_dim (its planes would run into the next head's).
def _width(bits, h, c, w):
    bits = bits.clone()
    bits[h, c] = w if w is not None else int(bits[h, c]) % 8 + 1  # None: another valid width
    return bits


@needs_kernels
@pytest.mark.parametrize("change,match", [
    (lambda b: b.long(), "key bits must be contiguous uint8"),
    (lambda b: b[:, :-1], "key bits must be contiguous uint8"),
    (lambda b: b[:1], "key bits must be contiguous uint8"),
    (lambda b: b.flatten(), "key bits must be contiguous uint8"),
    (lambda b: torch.stack([b, b], -1)[..., 0], "contiguous"),
    (lambda b: _width(b, 0, 0, 0), r"1\.\.8 a channel, got 0 for KV head 0 channel 0"),
    (lambda b: _width(b, 1, 5, 9), r"1\.\.8 a channel, got 9 for KV head 1 channel 5"),
    (lambda b: _width(b, 1, 3, None), "key bits must total 256 .* for KV head 1"),
], ids=["int64", "narrow", "one-head", "flat", "strided", "width0", "width9", "total"])
def test_int4_kernel_refuses_key_bits_it_cannot_read(change, match):
    q, k, v, meta = paged_batch([40], [], block_size=16, kvh=2, heads=4, hd=64)
    kp, vp, meta = int4_pools(k, v, meta, key_bits=mixed_key_bits(2, 64))
    bits = change(kp.key_bits)
    with pytest.raises(RuntimeError, match=match):
        decode_int4(torch.empty_like(q), q, kp.data, vp.data, kp.scales, kp.zero_points, bits,
                    vp.scales, kp.tail, vp.tail, kp.tails.slot_of, meta.decode_block_tables,
                    meta.decode_context_lens, 0.1)


@needs_kernels
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("hd", [64, 24])  # the AVX-512 loaders and the generic ones
def test_fused_kernel_dequantizes_every_stored_value_exactly(kind, hd):
    """A one-token context returns its value row: every stored bit pattern (fp8 subnormals
    included) times its scale, exactly as dequantize_kv gives it."""
    g = torch.Generator().manual_seed(3)
    width = hd
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
    decode_quantized(out, q, pool.data, pool.data, pool.scales, pool.scales,
                     torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.long), 0.1, kind)
    want = dequantize_kv(pool.data[:, 0, 0], pool.scales[:, 0, 0], kind, torch.float32)
    assert torch.equal(out, want.unsqueeze(1).expand(rows, 2, hd))


@needs_kernels
def test_fused_kernel_refuses_mismatched_quantized_pools():
    q, k, v, meta = paged_batch([20], [], block_size=16, kvh=2, heads=4, hd=64)
    pool = quantized(k, "int8")
    args = (meta.decode_block_tables, meta.decode_context_lens, 0.1)
    kernel = decode_quantized
    with pytest.raises(RuntimeError, match="fp8"):  # int8 bytes are not an fp8 pool
        kernel(torch.empty_like(q), q, pool.data, pool.data, pool.scales, pool.scales, *args, "fp8")
    with pytest.raises(RuntimeError, match="unknown kind"):
        kernel(torch.empty_like(q), q, pool.data, pool.data, pool.scales, pool.scales, *args, "int3")
    bad = meta.decode_block_tables.clone()
    bad[0, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(torch.empty_like(q), q, pool.data, pool.data, pool.scales, pool.scales, bad,
               meta.decode_context_lens, 0.1, "int8")
