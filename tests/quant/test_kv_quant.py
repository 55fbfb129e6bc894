"""KV cache quantization: round-trip error, slot writes, exact block copies, bytes per token, parity."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kv.cache import allocate_kv_caches, num_blocks_for_budget
from pagedserve.kv.quant import QuantizedKVCache, dequantize_kv, kv_cache_bytes_per_token, kv_dtype_name, quantize_kv
from pagedserve.models.attention import ATTENTION_BACKENDS, AttentionMetadata, reference_attention, write_kv

QUANTIZED = ["fp8", "int8", "int4"]
# Worst relative error per vector, as a share of its absmax: half a step of the grid.
BOUND = {"int8": 0.5 / 127 + 1e-3, "int4": 0.5 / 7 + 1e-3, "fp8": 1 / 16 + 1e-3}


@pytest.mark.parametrize("kind", QUANTIZED)
def test_round_trip_error_is_within_half_a_step(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=g) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    data, scales = quantize_kv(x, kind)
    assert scales.shape == (50, 4) and scales.dtype == torch.float16
    back = dequantize_kv(data, scales, kind, torch.float32)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    assert ((back - x).abs() <= BOUND[kind] * absmax).all()


def test_int4_packs_two_values_per_byte_and_zero_vectors_survive():
    x = torch.zeros(3, 2, 8)
    x[0, 0] = torch.tensor([7.0, -7.0, 1.0, -1.0, 0.0, 3.0, -3.0, 2.0])
    data, scales = quantize_kv(x, "int4")
    assert data.shape == (3, 2, 4) and data.dtype == torch.uint8
    back = dequantize_kv(data, scales, "int4", torch.float32)
    assert torch.allclose(back[0, 0], x[0, 0], atol=1e-2)
    assert torch.equal(back[1:], x[1:]) and torch.isfinite(back).all()


@pytest.mark.parametrize("kind", QUANTIZED)
def test_write_puts_each_token_in_its_slot_and_copies_are_exact(kind):
    cache = QuantizedKVCache.allocate(4, 2, 1, 8, kind, torch.float32, torch.device("cpu"))
    assert cache.shape == (4, 2, 1, 8)
    x = torch.randn(3, 1, 8)
    cache.write(torch.tensor([5, 0, 6]), x)  # block 2 slot 1, block 0 slot 0, block 3 slot 0
    full = cache.dequantize()
    tol = BOUND[kind] * x.abs().max()
    assert (full[2, 1] - x[0]).abs().max() <= tol
    assert (full[0, 0] - x[1]).abs().max() <= tol
    assert (full[3, 0] - x[2]).abs().max() <= tol
    assert torch.equal(full[1], torch.zeros(2, 1, 8))
    cache[torch.tensor([1])] = cache[torch.tensor([2])]  # copy-on-write, as the runner does it
    assert torch.equal(cache.data[1], cache.data[2]) and torch.equal(cache.scales[1], cache.scales[2])
    with pytest.raises(TypeError):
        cache[torch.tensor([1])] = torch.zeros(1, 2, 1, 8)


def test_bytes_per_token_include_the_scales():
    # The `small` shape: 12 layers, 4 KV heads, head_dim 64.
    bf16 = kv_cache_bytes_per_token(12, 4, 64, "auto", torch.bfloat16)
    assert bf16 == 12 * 1024
    assert kv_cache_bytes_per_token(12, 4, 64, "int8", torch.bfloat16) == 2 * 12 * 4 * (64 + 2)
    assert kv_cache_bytes_per_token(12, 4, 64, "fp8", torch.bfloat16) == 2 * 12 * 4 * (64 + 2)
    assert kv_cache_bytes_per_token(12, 4, 64, "int4", torch.bfloat16) == 2 * 12 * 4 * (32 + 2)
    assert kv_cache_bytes_per_token(12, 4, 64, "int8", torch.bfloat16) == 2 * 12 * 4 * 66
    budget = 8 * 4096 * bf16
    base = num_blocks_for_budget(budget, 16, bf16)
    assert num_blocks_for_budget(budget, 16, 2 * 12 * 4 * 66) / base > 1.9
    assert num_blocks_for_budget(budget, 16, 2 * 12 * 4 * 34) / base > 3.7
    with pytest.raises(ValueError):
        kv_cache_bytes_per_token(12, 4, 64, "int3", torch.bfloat16)


def test_allocated_pool_holds_exactly_the_bytes_the_formula_says():
    caches = allocate_kv_caches(3, 10, 16, 2, 64, torch.bfloat16, torch.device("cpu"), "int8")
    held = sum(k.nbytes + v.nbytes for k, v in caches)
    assert held == 10 * 16 * kv_cache_bytes_per_token(3, 2, 64, "int8", torch.bfloat16)
    assert kv_dtype_name("auto", torch.bfloat16) == "bfloat16" and kv_dtype_name("int4", torch.bfloat16) == "int4"


def _quantized_batch(kind, dtype, block_size=4, kvh=2, heads=6, hd=8, seed=0):
    """Quantized caches filled through write_kv, decodes and prompt chunks over scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    dev = torch.device("cpu")
    k_cache = QuantizedKVCache.allocate(num_blocks, block_size, kvh, hd, kind, dtype, dev)
    v_cache = QuantizedKVCache.allocate(num_blocks, block_size, kvh, hd, kind, dtype, dev)
    slots = torch.randperm(num_blocks * block_size, generator=g)
    write_kv(k_cache, v_cache, torch.randn(len(slots), kvh, hd, generator=g).to(dtype),
             torch.randn(len(slots), kvh, hd, generator=g).to(dtype), slots)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    decode_ctx, prefills = [1, 5, 17, 33], [(7, 7), (5, 30), (1, 9)]
    tables = [torch.tensor([perm.pop() for _ in range(-(-c // block_size))])
              for c in decode_ctx + [c for _, c in prefills]]
    d = len(decode_ctx)
    width = max(len(t) for t in tables[:d])
    dt = torch.zeros(d, width, dtype=torch.long)
    for i in range(d):
        dt[i, :len(tables[i])] = tables[i]
    ctx = torch.tensor(decode_ctx)
    mask = (torch.arange(width * block_size)[None] < ctx[:, None])[:, None, None, :]
    pre, start = [], d
    for (q_len, c), table in zip(prefills, tables[d:]):
        pre.append((start, q_len, c, table))
        start += q_len
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), d, dt, ctx, mask, pre)
    return torch.randn(start, heads, hd, generator=g).to(dtype), k_cache, v_cache, meta


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_quantized_attention_matches_float_reference_on_the_same_inputs(kind, backend, dtype, atol):
    """Every backend reading the quantized pool = the float reference on the dequantized pool."""
    q, k_cache, v_cache, meta = _quantized_batch(kind, dtype)
    want = reference_attention(q.float(), k_cache.dequantize().float(), v_cache.dequantize().float(), meta, 0.3)
    got = ATTENTION_BACKENDS[backend](q, k_cache, v_cache, meta, 0.3)
    assert torch.allclose(got.float(), want, atol=atol)


@pytest.mark.parametrize("kind", QUANTIZED)
def test_quantized_attention_is_close_to_unquantized_attention(kind):
    """The quality side: attention over quantized K/V stays near attention over the originals."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(32, 2, 16, generator=g)
    v = torch.randn(32, 2, 16, generator=g)
    dev = torch.device("cpu")
    caches = [QuantizedKVCache.allocate(8, 4, 2, 16, kind, torch.float32, dev) for _ in range(2)]
    slots = torch.arange(32)
    write_kv(caches[0], caches[1], k, v, slots)
    meta = AttentionMetadata(slots, 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                             None, [(0, 32, 32, torch.arange(8))])
    q = torch.randn(32, 4, 16, generator=g)
    exact = reference_attention(q, k.view(8, 4, 2, 16), v.view(8, 4, 2, 16), meta, 0.25)
    approx = reference_attention(q, caches[0], caches[1], meta, 0.25)
    err = (approx - exact).abs().max()
    assert err < {"int8": 0.03, "fp8": 0.15, "int4": 0.4}[kind]
