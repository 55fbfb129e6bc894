"""Random paged attention inputs shared by the attention-backend and native-kernel tests."""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.kv.cache import HeadMajorKVCache
from pagedserve.kv.quant import QuantizedKVCache
from pagedserve.models.attention import AttentionMetadata


def paged_batch(decode_ctx, prefills, block_size=4, kvh=2, heads=6, hd=8, dtype=torch.float32, seed=0,
                num_blocks=96):
    """Random caches and a batch of decodes (context lengths) and prompt chunks (q_len, ctx_len)."""
    g = torch.Generator().manual_seed(seed)
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


def head_major(cache: torch.Tensor) -> HeadMajorKVCache:
    """The same blocks as an engine pool (stored ``[kv_heads, blocks, block_size, head_dim]``)."""
    nb, bs, kvh, hd = cache.shape
    pool = HeadMajorKVCache(nb, bs, kvh, hd, cache.dtype, torch.device("cpu"))
    pool.data.copy_(cache.permute(2, 0, 1, 3))
    return pool


def quantized(cache: torch.Tensor, kind: str) -> QuantizedKVCache:
    """The same blocks quantized into an engine pool, through its own write path."""
    nb, bs, kvh, hd = cache.shape
    pool = QuantizedKVCache.allocate(nb, bs, kvh, hd, kind, cache.dtype, torch.device("cpu"))
    pool.write(torch.arange(nb * bs), cache.flatten(0, 1))
    return pool


def in_float32(pool: QuantizedKVCache) -> QuantizedKVCache:
    """The same stored bits, scales and rotation, dequantized to float32 when gathered."""
    return replace(pool, out_dtype=torch.float32)


def int4_pools(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, chunk: int = 5,
               tail_slots: int | None = None, key_bits: torch.Tensor | None = None):
    """The batch's K/V written into int4 pools (kv/int4.py) as an engine writes them: each sequence's
    earlier tokens in prompt chunks of ``chunk``, then the step's tokens (a decode's last, a chunk's
    ``q_len``) in one write; the keys at ``key_bits`` a channel (default 4 each). Returns the K and V
    pools and ``meta`` with the step's slot mapping."""
    from pagedserve.kv.cache import allocate_kv_caches

    nb, bs, kvh, hd = k_cache.shape
    k, v = allocate_kv_caches(1, nb, bs, kvh, hd, torch.float32, torch.device("cpu"), "int4", tail_slots)[0]
    if key_bits is not None:
        k = k.with_key_bits(key_bits)
    seqs = [(meta.decode_block_tables[i], int(meta.decode_context_lens[i]), 1) for i in range(meta.num_decodes)]
    seqs += [(table, ctx, q_len) for _, q_len, ctx, table in meta.prefills]

    def write(table, lo, hi):
        pos = torch.arange(lo, hi)
        slots = table[pos // bs] * bs + pos % bs
        k.write(slots, k_cache[table].flatten(0, 1)[lo:hi].float())
        v.write(slots, v_cache[table].flatten(0, 1)[lo:hi].float())
        return slots

    for table, ctx, n in seqs:
        for lo in range(0, ctx - n, chunk):
            write(table, lo, min(lo + chunk, ctx - n))
    step = [(table, ctx - n, ctx) for table, ctx, n in seqs]
    pos = [torch.arange(lo, hi) for _, lo, hi in step]
    slot_mapping = torch.cat([t[p // bs] * bs + p % bs for (t, _, _), p in zip(step, pos)])
    k.write(slot_mapping, torch.cat([k_cache[t].flatten(0, 1)[lo:hi] for t, lo, hi in step]).float())
    v.write(slot_mapping, torch.cat([v_cache[t].flatten(0, 1)[lo:hi] for t, lo, hi in step]).float())
    return k, v, replace(meta, slot_mapping=slot_mapping)


def mixed_key_bits(kv_heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Key bits ``[kv_heads, head_dim]`` (kv/int4.py's check_key_bits) with every width 1..8 in use:
    bits moved at random between channels of a head, 4 a channel on average."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.full((kv_heads, head_dim), 4, dtype=torch.long)
    for h in range(kv_heads):
        for _ in range(8 * head_dim):
            a, b = torch.randint(head_dim, (2,), generator=g).tolist()
            if bits[h, a] < 8 and bits[h, b] > 1:
                bits[h, a] += 1
                bits[h, b] -= 1
    return bits.to(torch.uint8)
