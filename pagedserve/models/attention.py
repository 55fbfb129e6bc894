"""Paged attention: write new K/V into their slots, then attend through each block table.

The flat batch holds ``num_decodes`` one-token sequences first, then prompt chunks. Four
backends compute the same thing:

* ``reference`` — plain torch, one sequence at a time, explicit masked softmax in float32.
  Obviously correct; every faster path is tested against it.
* ``sdpa`` — decodes batched into one gather + ``scaled_dot_product_attention`` call; prompt
  chunks one SDPA call each (few per step). The default on GPU.
* ``matmul`` — decodes and prompt chunks as two batched matmuls per KV head, with the query
  heads that share it grouped together. On CPU, SDPA's kernel is slow here (measured ~5x slower
  for 32 one-token queries over 200-700 tokens, 2-3x for prompt chunks).
* ``fused`` — prompt chunks as in ``matmul`` with mask and softmax as one native pass; decodes through a native kernel
  (:mod:`pagedserve.kernels`) that reads each block once, in place, instead of gathering the
  batch's blocks into a padded copy first (~3x faster decode attention on W1's batches). The
  default on CPU when the kernel builds.

The K and V caches are the engine's :class:`~pagedserve.kv.cache.HeadMajorKVCache` pools, plain
``[blocks, block_size, kv_heads, head_dim]`` tensors (tests), or :class:`~pagedserve.kv.quant.QuantizedKVCache` pools
(int8 / fp8 with per-token, per-head scales) or :class:`~pagedserve.kv.int4.Int4KVCache` pools (int4:
keys per channel within a block with zero points, values rotated per token, each sequence's open
block in a float16 tail): ``write_kv`` quantizes on write. Backends gather the blocks they read (head-major pools in
one copy, quantized pools dequantizing only the blocks gathered), except the fused decode kernel,
which reads head-major and quantized pools in place, dequantizing as it goes. int4 values are
stored rotated by a Hadamard matrix (:func:`_attention`): ``sdpa``, ``matmul`` and ``fused``
then attend in the stored basis and rotate the output back; ``reference`` instead rotates every
gathered value back. Over int4 pools every query reads its own block exact: a decode from the
tail (the block it fills this step included), a prompt chunk's queries from the step's rows at
the tail's precision (``matmul`` and ``fused``: :func:`_prefill_own_exact`'s diagonal tiles;
``sdpa`` and ``reference``: :func:`own_block_exact`'s mask). ``fused`` decodes go through
the ``matmul`` path where the kernel cannot: plain-tensor pools, more than
``FUSED_DECODE_MAX_GROUP`` query heads per KV head, or no native build.

A fifth, ``triton`` (:mod:`pagedserve.models.triton_attention`, the default on CUDA), reads and
writes the pools in place with Triton kernels; :func:`load_attention_backend` imports it only when it
is asked for, since Triton is an optional dependency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pagedserve.kernels import native_ops
from pagedserve.kv.cache import HeadMajorKVCache, KVCache
from pagedserve.kv.int4 import Int4KVCache
from pagedserve.kv.quant import QuantizedKVCache, gather_blocks
from pagedserve.kv.sizing import window_blocks


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot index for each new token's K/V
    num_decodes: int  # the first num_decodes tokens are one-token sequences
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decodes] tokens attended to, the new one included
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool, or None
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (query start, query len, context len, block ids)
    # A sliding-window layer's view (:func:`window_view`): a query at position p sees keys at
    # positions > p - window only. None: every earlier key (full attention).
    window: int | None = None
    # With a window, each decode's first visible position of its table ([num_decodes] int64,
    # inside the table's first block): what decode_mask hides before it, for the fused kernel.
    decode_first: torch.Tensor | None = None

    @cached_property
    def prefill_tensors(self) -> PrefillTensors:
        """The prompt chunks as device tensors, for kernels that take every chunk in one launch;
        built on first use, once per step (every layer reads the same)."""
        return PrefillTensors.of(self.prefills, self.slot_mapping.device)


@dataclass(frozen=True)
class PrefillTensors:
    """A step's prompt chunks, one row each: where its queries start in the flat batch, how many,
    its context length, and its block table (padded with block 0 to the widest)."""

    query_starts: torch.Tensor  # [chunks] int32
    query_lens: torch.Tensor  # [chunks] int32
    context_lens: torch.Tensor  # [chunks] int32
    block_tables: torch.Tensor  # [chunks, max blocks] int32
    max_query_len: int  # on the host: sizes a kernel's grid without a device sync

    @classmethod
    def of(cls, prefills: list[tuple[int, int, int, torch.Tensor]], device: torch.device) -> PrefillTensors:
        width = max((len(ids) for *_, ids in prefills), default=0)
        # Built where the block ids already are (the runner puts them on the device): no copy back.
        tables = torch.zeros(len(prefills), width, dtype=torch.int32, device=device)
        for i, (*_, ids) in enumerate(prefills):
            tables[i, :len(ids)] = ids
        numbers = torch.tensor([p[:3] for p in prefills], dtype=torch.int32).reshape(-1, 3).T.contiguous()
        return cls(*numbers.to(device), tables, max((p[1] for p in prefills), default=0))


def window_view(meta: AttentionMetadata, window: int, block_size: int) -> AttentionMetadata:
    """``meta`` as a sliding-window layer reads it: each decode's table starts at the block holding
    its oldest key still in the window (its context length counted from there, its mask cut to
    the window), so a decode reads about ``window`` tokens, not its whole context; prompt chunks
    keep their tables and every backend masks them by ``window``. Built once per step, shared by
    every sliding layer. The slots written (``slot_mapping``) are unchanged."""
    if not meta.num_decodes:
        return dataclasses.replace(meta, window=window)
    ctx = meta.decode_context_lens
    first = (ctx - window).clamp(min=0) // block_size  # block of the oldest key in the window
    width = min(meta.decode_block_tables.shape[1], window_blocks(window, block_size))
    last = meta.decode_block_tables.shape[1] - 1
    cols = (first.unsqueeze(1) + torch.arange(width, device=ctx.device)).clamp(max=last)
    tables = meta.decode_block_tables.gather(1, cols).contiguous()
    lens = ctx - first * block_size
    span = torch.arange(width * block_size, device=ctx.device).unsqueeze(0)
    first = (lens - window).clamp(min=0)
    mask = (span < lens.unsqueeze(1)) & (span >= first.unsqueeze(1))
    return dataclasses.replace(meta, decode_block_tables=tables, decode_context_lens=lens,
                               decode_mask=mask[:, None, None, :], window=window, decode_first=first)


def write_kv(k_cache: KVCache, v_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values ``[T, kv_heads, head_dim]`` into their slots."""
    if not isinstance(k_cache, torch.Tensor):  # a pool object (head-major or quantized) stores itself
        k_cache.write(slot_mapping, k)
        v_cache.write(slot_mapping, v)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _decode_view(cache: KVCache) -> KVCache:
    """``cache`` as decodes read it: an int4 block filled by this step's decode still from its tail
    (:meth:`~pagedserve.kv.int4.Int4KVCache.decode_view`); other pools as they are."""
    return cache.decode_view() if isinstance(cache, Int4KVCache) else cache


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain, per-sequence paged attention. ``q`` is ``[T, heads, head_dim]``."""
    out = torch.empty_like(q)
    seqs = [(i, 1, int(meta.decode_context_lens[i]), meta.decode_block_tables[i])
            for i in range(meta.num_decodes)] + meta.prefills
    decode_k, decode_v = _decode_view(k_cache), _decode_view(v_cache)
    block_size = k_cache.shape[1]
    for i, (start, q_len, ctx_len, block_ids) in enumerate(seqs):
        pools = (decode_k, decode_v) if i < meta.num_decodes else (k_cache, v_cache)
        k, v = (gather_blocks(pool, block_ids).flatten(0, 1)[:ctx_len].float() for pool in pools)
        hidden = ~_visible(q_len, ctx_len, meta.window, k.device)
        if isinstance(k_cache, Int4KVCache) and i >= meta.num_decodes:  # a prompt chunk's own block, exact
            lead, block = (ctx_len - q_len) % block_size, int(block_ids[(ctx_len - q_len) // block_size])
            k, v = (torch.cat([x, pool.own_block_rows(start, q_len, lead, block)]) for x, pool in zip((k, v), pools))
            hidden = ~own_block_exact(q_len, ctx_len, block_size, meta.window, k.device)
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))  # [ctx, heads, d]
        qs = q[start:start + q_len].float()  # [q_len, heads, d]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def _decode_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # [D, blocks, block_size, kvh, hd] -> [D, kvh, L, hd]
    k, v = (gather_blocks(c, meta.decode_block_tables).flatten(1, 2).transpose(1, 2).to(q.dtype)
            for c in (k_cache, v_cache))
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=meta.decode_mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


def gather_head_major(cache: KVCache, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` (any shape ``S``) as a contiguous ``[kv_heads, *S, block_size, head_dim]``."""
    if hasattr(cache, "gather_head_major"):  # the engine's head-major pool: one gather, no transpose
        return cache.gather_head_major(block_ids)
    return gather_blocks(cache, block_ids).movedim(-2, 0).contiguous()


def _decode_matmul(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    d, heads, hd = q.shape
    # [kvh, D, L, hd]
    k, v = (gather_head_major(c, meta.decode_block_tables).flatten(2, 3).to(q.dtype) for c in (k_cache, v_cache))
    kvh = k.shape[0]
    # The query heads that share each KV head form the rows of one small matmul per (head, seq).
    qg = (q * scale).view(d, kvh, heads // kvh, hd).transpose(0, 1)  # [kvh, D, group, hd]
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [kvh, D, group, L]
    scores.masked_fill_(~meta.decode_mask.view(1, d, 1, -1), float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).transpose(0, 1).reshape(d, heads, hd)


# The native decode kernel keeps one KV head's query group in registers: up to this many query
# heads per KV head (Llama 3 70B has 8). Wider groups decode through the matmul path.
FUSED_DECODE_MAX_GROUP = 8


def _decode_fused(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
    """Decodes through the native kernel, reading each block in place from the head-major or the
    quantized pools (dequantizing as it reads); what it cannot read (plain-tensor pools, more than
    :data:`FUSED_DECODE_MAX_GROUP` query heads per KV head) goes through :func:`_decode_matmul`."""
    kernel = None  # and, with one: the dtype it computes in, the pools' tensors, its mode argument
    ops = native_ops()
    if ops is not None and q.device.type == "cpu" and q.shape[1] <= FUSED_DECODE_MAX_GROUP * k_cache.shape[2]:
        if isinstance(k_cache, Int4KVCache):
            kernel, dtype, mode = ops.paged_decode_attention_int4, q.dtype, ("auto",)
            pools = k_cache.decode_kernel_pools(v_cache)
        elif isinstance(k_cache, QuantizedKVCache):
            kernel, dtype, mode = ops.paged_decode_attention_quantized, q.dtype, (k_cache.kv_cache_dtype,)
            pools = (k_cache.data, v_cache.data, k_cache.scales, v_cache.scales)
        elif isinstance(k_cache, HeadMajorKVCache):
            # The kernel computes in the pools' dtype: bf16 pools under float32 compute (a CPU without
            # native bf16) take q converted and give the output back; otherwise no conversion call at all.
            kernel, dtype, mode, pools = ops.paged_decode_attention, k_cache.dtype, (), (k_cache.data, v_cache.data)
    if kernel is None:
        return _decode_matmul(q, k_cache, v_cache, meta, scale)
    q = q.contiguous()
    out = torch.empty_like(q, dtype=dtype)
    kernel(out, q if q.dtype == dtype else q.to(dtype), *pools, meta.decode_block_tables, meta.decode_context_lens,
           scale, *mode, meta.decode_first)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _visible(q_len: int, ctx_len: int, window: int | None, device) -> torch.Tensor:
    """``[q_len, ctx]`` bool: which keys each of a chunk's queries (the context's last ``q_len``
    positions) sees: up to itself, and with a ``window`` only those > its position - window."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx_len, device=device).unsqueeze(0)
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


@dataclass
class ExactRows:
    """A prompt chunk's own rows over int4 pools (:meth:`~pagedserve.kv.int4.Int4KVCache.own_block_rows`):
    ``k``, ``v`` ``[kvh, lead + q_len, hd]`` from the start of the chunk's first block, exact."""

    k: torch.Tensor
    v: torch.Tensor
    lead: int
    block_size: int

    def from_query(self, first: int, n: int) -> ExactRows:
        """The rows queries ``first .. first + n`` of the chunk read: from their first one's block start."""
        lead = (self.lead + first) % self.block_size
        start = self.lead + first - lead  # the exact row where query first's block starts
        return ExactRows(self.k[:, start:start + lead + n], self.v[:, start:start + lead + n], lead, self.block_size)


def _diagonal_tiles(grid: torch.Tensor, first: int, block_size: int) -> torch.Tensor:
    """``grid [kvh, group, R, C]`` (contiguous, ``C = first + R``, ``R`` whole blocks) → the view
    ``[kvh, group, R / block, block, block]`` of the tiles where row block ``b`` meets column block
    ``first / block + b``: each padded query block's own keys."""
    kvh, group, rows, cols = grid.shape
    bs = block_size
    return grid.as_strided((kvh, group, rows // bs, bs, bs), (group * rows * cols, rows * cols, bs * cols + bs, cols, 1),
                           grid.storage_offset() + first)


def _prefill_own_exact(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exact: ExactRows, causal_softmax,
                       window: int | None) -> torch.Tensor:
    """A chunk over int4 pools as grouped GEMMs, each query reading its own block exact. The
    queries are padded to whole blocks (``lead`` rows before, the rest after) and the keys to
    ``first + R`` columns, so that each query block's own keys form one diagonal tile of the score
    matrix: the tiles take the exact rows' scores (a ``block × block`` product each, not the whole
    chunk again), the causal softmax runs over the padded rows as they stand, and the tiles'
    weights add ``P·(V_exact − V)`` to ``P·V``. ``qg [kvh, group, q_len, hd]`` (scaled)."""
    kvh, group, q_len, hd = qg.shape
    bs, lead, ctx = exact.block_size, exact.lead, k.shape[1]
    rows = -(-(lead + q_len) // bs) * bs
    first = ctx - q_len - lead  # the chunk's first block starts here
    back = rows - lead - q_len
    qp = F.pad(qg, (0, 0, lead, back))
    kp, vp = F.pad(k, (0, 0, 0, back)), F.pad(v, (0, 0, 0, back))  # columns first + rows
    scores = torch.matmul(qp.reshape(kvh, group * rows, hd), kp.transpose(-1, -2))
    blocks = rows // bs
    kx, vx = F.pad(exact.k, (0, 0, 0, back)), F.pad(exact.v, (0, 0, 0, back))
    tiles = _diagonal_tiles(scores.view(kvh, group, rows, first + rows), first, bs)
    tiles.copy_(torch.matmul(qp.view(kvh, group, blocks, bs, hd), kx.view(kvh, 1, blocks, bs, hd).transpose(-1, -2)))
    probs = causal_softmax(scores, rows, window)  # row r sits at position first + r, as padded
    out = torch.matmul(probs, vp).view(kvh, group, blocks, bs, hd)
    weights = _diagonal_tiles(probs.view(kvh, group, rows, first + rows), first, bs)
    out += torch.matmul(weights, (vx - vp[:, first:]).view(kvh, 1, blocks, bs, hd))
    return out.view(kvh, group, rows, hd)[:, :, lead:lead + q_len]


def own_block_exact(q_len: int, ctx_len: int, block_size: int, window: int | None, device) -> torch.Tensor:
    """``[q_len, ctx + exact]`` bool over int4 pools: which of the gathered keys (the first ``ctx``,
    dequantized or from the tail) and of the chunk's exact rows (the rest, from its first block's
    start: :meth:`~pagedserve.kv.int4.Int4KVCache.own_block_rows`) each query sees: the exact row
    for a key in the query's own block, the gathered one for earlier blocks. A query thus reads
    what it would read decoded, its own block exact and every earlier block quantized, however
    the prompt is chunked (examples/int4_kv_study.py's ``+tail``)."""
    seen = _visible(q_len, ctx_len, window, device)
    first = (ctx_len - q_len) // block_size * block_size  # the chunk's first block starts here
    q_block = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1) // block_size
    own = torch.arange(ctx_len, device=device).unsqueeze(0) // block_size == q_block
    return torch.cat([seen & ~own, (own & seen)[:, first:]], dim=1)


def _prefill_sdpa(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  window: int | None = None, exact: ExactRows | None = None) -> torch.Tensor:
    """One prompt chunk ``[heads, q_len, hd]`` against its context ``[kvh, ctx, hd]`` through SDPA
    (with ``exact``, int4's: the exact rows appended to the keys under :func:`own_block_exact`)."""
    q_len, ctx_len = qs.shape[1], k.shape[1]
    if exact is not None:
        mask = own_block_exact(q_len, ctx_len, exact.block_size, window, qs.device)
        k, v = torch.cat([k, exact.k], 1), torch.cat([v, exact.v], 1)
    elif ctx_len == q_len and (window is None or window >= ctx_len):
        return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = _visible(q_len, ctx_len, window, qs.device)
    return F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


# Largest score matrix (elements) the matmul prefill materialises at once: a longer chunk is taken
# in blocks of its queries, each against the keys its last query sees.
_MATMUL_PREFILL_MAX_SCORES = 1 << 25
# Queries per block past which a chunk is split anyway, by the scores' dtype: each block multiplies
# only the keys up to its last query, so most of the causal upper half is never computed (`small`'s
# shapes in bf16 on a Zen 5, one layer: 512 tokens 1.22 -> 1.10 ms, 1,024 4.94 -> 3.56, 2,048
# 37.8 -> 14.3; blocks of 128 and 64 measured slower: smaller GEMMs). In float32 smaller blocks win,
# the skipped products costing more than the smaller GEMMs lose (SmolLM2-135M's shapes, one layer,
# the same Zen 5, 256 -> 96 rows: 512 tokens 3.19 -> 2.74 ms, 1,024 10.79 -> 9.75; with torch held
# to AVX2 3.52 -> 2.91, 13.45 -> 10.49; docs/BENCHMARKS.md, "An int16 GEMM for prompt chunks on AVX2").
_CAUSAL_BLOCK_ROWS = {torch.bfloat16: 256, torch.float32: 96}


def _causal_block_rows(dtype: torch.dtype) -> int:
    return _CAUSAL_BLOCK_ROWS.get(dtype, 256)


def _masked_softmax(scores: torch.Tensor, q_len: int, window: int | None = None) -> torch.Tensor:
    """Causal softmax of grouped scores ``[kvh, group * q_len, ctx]``: the chunk's queries are the
    context's last ``q_len`` positions, each seeing keys up to itself (and within ``window``)."""
    ctx_len = scores.shape[-1]
    hidden = ~_visible(q_len, ctx_len, window, scores.device)  # [q_len, ctx]
    scores.view(-1, q_len, ctx_len).masked_fill_(hidden, float("-inf"))
    return scores.softmax(dim=-1)


def _native_causal_softmax(scores: torch.Tensor, q_len: int, window: int | None = None) -> torch.Tensor:
    """:func:`_masked_softmax` as one native pass, in place (no exp over the masked half); the
    kernel masks the future only, so a window goes through the torch mask."""
    if window is not None and window < scores.shape[-1]:
        return _masked_softmax(scores, q_len, window)
    native_ops().causal_softmax_(scores.view(-1, q_len, scores.shape[-1]), q_len)  # rows: (kv head, group, query)
    return scores


def _prefill_gemms(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                   exact: ExactRows | None, causal_softmax) -> torch.Tensor:
    """:func:`_prefill_matmul`'s two GEMMs around the causal softmax, whatever the scores' size."""
    heads, q_len, hd = qs.shape
    kvh = k.shape[0]
    qg = (qs * scale).reshape(kvh, heads // kvh * q_len, hd)
    if exact is not None:
        return _prefill_own_exact(qg.view(kvh, heads // kvh, q_len, hd), k, v, exact, causal_softmax,
                                  window).reshape(heads, q_len, hd)
    scores = torch.matmul(qg, k.transpose(-1, -2))
    return torch.matmul(causal_softmax(scores, q_len, window), v).view(heads, q_len, hd)


def _prefill_matmul(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                    exact: ExactRows | None = None, causal_softmax=_masked_softmax) -> torch.Tensor:
    """The same as :func:`_prefill_sdpa` as two GEMMs per KV head around a masked softmax, the query
    heads that share it as one matrix: 2-3x faster than SDPA's CPU kernel for chunks of a few hundred
    tokens (measured: 290 tokens 4.2 → 1.5 ms a layer). With ``exact`` (int4 pools), each query reads
    its own block from the exact rows (:func:`_prefill_own_exact`).

    A chunk of more than :data:`_CAUSAL_BLOCK_ROWS` queries (by dtype), or whose score matrix would be too
    large, is taken in blocks of its queries, each block's scores within
    :data:`_MATMUL_PREFILL_MAX_SCORES` (through SDPA a 2,048-token prompt took 2.57 s on ``small``
    against 0.44 s): a block is the last queries of the context up to its last one, so it reads only
    the keys that one sees (the causal half of the products is skipped too), and over int4 pools the
    exact rows from its own first block's start."""
    heads, q_len, _ = qs.shape
    ctx_len = k.shape[1]
    block_rows = _causal_block_rows(qs.dtype)
    if q_len <= block_rows and heads * q_len * ctx_len <= _MATMUL_PREFILL_MAX_SCORES:
        return _prefill_gemms(qs, k, v, scale, window, exact, causal_softmax)
    rows = min(block_rows, max(16, _MATMUL_PREFILL_MAX_SCORES // (heads * ctx_len) // 16 * 16))
    out = torch.empty_like(qs)
    for first in range(0, q_len, rows):
        n = min(rows, q_len - first)
        seen = ctx_len - q_len + first + n  # keys up to the block's last query
        own = None if exact is None else exact.from_query(first, n)
        out[:, first:first + n] = _prefill_gemms(qs[:, first:first + n], k[:, :seen], v[:, :seen], scale, window,
                                                 own, causal_softmax)
    return out


def _prefill_fused(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   window: int | None = None, exact: ExactRows | None = None) -> torch.Tensor:
    """:func:`_prefill_matmul` with the causal mask and softmax as one native pass over the scores."""
    native = native_ops() is not None and qs.device.type == "cpu"
    return _prefill_matmul(qs, k, v, scale, window, exact, _native_causal_softmax if native else _masked_softmax)


def _attention(decode, prefill, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batched decodes through ``decode``, then each prompt chunk through ``prefill``. Under a
    window, a chunk reads its context from the block holding the first key its first query sees.

    Over int4 pools, whose values are stored rotated (:attr:`Int4KVCache.rotation`), all *in the
    stored basis*: the pools read as stored (:meth:`Int4KVCache.stored_basis`), in float32, and the
    output rotated back. With an orthogonal, symmetric ``R``, ``(Σ p vR) R = Σ p v``: the same
    attention, for one ``head_dim × head_dim`` product per output row, where rotating back every
    gathered value row would cost one per context token (and the fused kernel reads the stored rows
    in place, so it could not)."""
    if isinstance(v_cache, Int4KVCache) and v_cache.rotation is not None:
        out = _attention(decode, prefill, q.float(), k_cache.stored_basis(), v_cache.stored_basis(), meta, scale)
        return v_cache.rotate(out).to(q.dtype)  # float32 until here: one rounding, as without it
    d = meta.num_decodes
    if d and not meta.prefills:  # decode-only step (the common one): nothing to assemble
        return decode(q, _decode_view(k_cache), _decode_view(v_cache), meta, scale)
    out = torch.empty_like(q)
    if d:
        out[:d] = decode(q[:d], _decode_view(k_cache), _decode_view(v_cache), meta, scale)
    block_size = k_cache.shape[1]
    for start, q_len, ctx_len, block_ids in meta.prefills:
        first = 0 if meta.window is None else max(0, ctx_len - q_len + 1 - meta.window) // block_size
        ids = block_ids[first:]
        ctx = ctx_len - first * block_size  # counted from the first block read
        # [kvh, ctx, hd] each; .to: pools may hold bf16 under float32 compute (a CPU without native bf16), else no-op
        k, v = (gather_head_major(c, ids).flatten(1, 2)[:, :ctx].to(q.dtype) for c in (k_cache, v_cache))
        qs = q[start:start + q_len].transpose(0, 1)  # [heads, q_len, hd]
        exact = None
        if isinstance(k_cache, Int4KVCache):  # each query reads its own block from the exact rows
            lead, block = (ctx - q_len) % block_size, int(ids[(ctx - q_len) // block_size])
            exact = ExactRows(*(c.own_block_rows(start, q_len, lead, block).transpose(0, 1).to(q.dtype)
                                for c in (k_cache, v_cache)), lead, block_size)
        out[start:start + q_len] = prefill(qs, k, v, scale, meta.window, exact).transpose(0, 1)
    return out


# The fast backends read int4 pools in the stored basis (_attention). The reference does not: it gathers
# the values rotated back into the model's basis (Int4KVCache.dequantize), slowly and obviously, so
# testing the others against it tests the rotation algebra too.
def sdpa_attention(q, k_cache, v_cache, meta, scale):
    """Decodes batched through SDPA (good on GPU); prompt chunks through SDPA."""
    return _attention(_decode_sdpa, _prefill_sdpa, q, k_cache, v_cache, meta, scale)


def matmul_attention(q, k_cache, v_cache, meta, scale):
    """Decodes and prompt chunks as grouped batched matmuls (fast on CPU)."""
    return _attention(_decode_matmul, _prefill_matmul, q, k_cache, v_cache, meta, scale)


def fused_attention(q, k_cache, v_cache, meta, scale):
    """Decodes through the fused native kernel (no gathered copy); prompt chunks as grouped matmuls
    around a native causal softmax."""
    return _attention(_decode_fused, _prefill_fused, q, k_cache, v_cache, meta, scale)


ATTENTION_BACKENDS = {"reference": reference_attention, "sdpa": sdpa_attention, "matmul": matmul_attention,
                      "fused": fused_attention}


@dataclass(frozen=True)
class AttentionBackend:
    """What a model layer calls: ``write`` stores the step's new K and V by slot mapping, then
    ``attend`` computes attention through the block tables."""

    attend: Callable[..., torch.Tensor]
    write: Callable[..., None] = write_kv


def load_attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` (any of ``config.ATTENTION_BACKEND_NAMES`` but ``auto``). ``triton``
    brings its own KV write (one kernel, quantizing as it stores) and is imported only when asked
    for: Triton is an optional dependency."""
    if name == "triton":
        from pagedserve.models.triton_attention import triton_attention, triton_write_kv

        return AttentionBackend(triton_attention, triton_write_kv)
    return AttentionBackend(ATTENTION_BACKENDS[name])
