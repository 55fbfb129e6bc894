"""The ``triton`` attention backend: the engine's paged pools read and written in place by the
Triton kernels of :mod:`pagedserve.kernels.triton_paged` (the default on ``--device cuda`` when
Triton is installed).

Where the ``sdpa`` backend gathers each step's blocks into padded copies and attends over them,
this one gives the kernels the pools as they are (a :class:`PoolView` of each: head-major float
pools, int8 / fp8 pools with their scales, or plain tensors) with the block tables: decodes in
one split-K launch, every prompt chunk of the step in one varlen launch, and the step's K and V
written by slot mapping in one launch per layer (quantized as they are stored). Padding rows
(negative slots, context length 0) cost nothing and write nothing, which is what lets a CUDA graph
replay a fixed-size decode batch (:mod:`pagedserve.engine.core.cuda_graphs`).

int4 pools (kv/int4.py) have no Triton kernel: the engine does not pair them with this backend.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.triton_paged.availability import TRITON_KV_DTYPES
from pagedserve.kernels.triton_paged.decode import paged_decode
from pagedserve.kernels.triton_paged.kv_write import write_kv as write_kv_kernel
from pagedserve.kernels.triton_paged.pools import PoolView
from pagedserve.kernels.triton_paged.prefill import paged_prefill
from pagedserve.kv.cache import HeadMajorKVCache, KVCache
from pagedserve.kv.quant import QuantizedKVCache
from pagedserve.models.attention import AttentionMetadata


def pool_view(cache: KVCache) -> PoolView:
    """How the kernels address one of the engine's pools (or a plain ``[blocks, block_size, kv_heads,
    head_dim]`` tensor)."""
    if isinstance(cache, HeadMajorKVCache):
        return PoolView.head_major(cache.data)
    if isinstance(cache, QuantizedKVCache):
        return PoolView.token_major(cache.data, cache.kv_cache_dtype, cache.scales)
    if not isinstance(cache, torch.Tensor):  # int4 (kv/int4.py)
        raise ValueError(f"the triton backend has no kernel for int4 KV pools; use one of "
                         f"{', '.join(TRITON_KV_DTYPES)} or another attention backend")
    return PoolView.token_major(cache)


def triton_write_kv(k_cache: KVCache, v_cache: KVCache, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values ``[T, kv_heads, head_dim]`` at their slots (negative: skipped)."""
    write_kv_kernel(pool_view(k_cache), pool_view(v_cache), k, v, slot_mapping)


def triton_attention(q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """Decodes through the split-K decode kernel, prompt chunks through the varlen prefill kernel."""
    k_pool, v_pool = pool_view(k_cache), pool_view(v_cache)
    out = torch.empty_like(q)
    d = meta.num_decodes
    if d:
        paged_decode(out[:d], q[:d], k_pool, v_pool, meta.decode_block_tables, meta.decode_context_lens, scale)
    if meta.prefills:
        chunks = meta.prefill_tensors
        paged_prefill(out, q, k_pool, v_pool, chunks.block_tables, chunks.query_starts, chunks.query_lens,
                      chunks.context_lens, chunks.max_query_len, scale)
    return out
