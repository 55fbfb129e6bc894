"""KV cache tensors, sized from a memory budget with the planner's bytes-per-token formula."""

from __future__ import annotations

import torch

from pagedserve.kv.quant import QuantizedKVCache, quantized_kv_bytes_per_token

KVCache = torch.Tensor | QuantizedKVCache  # one layer's K (or V) pool


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto") -> int:
    """Real bytes one token's K and V take across all layers: model ``dtype`` for ``auto``, else the
    quantized precision plus its per-token, per-head scales."""
    return quantized_kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_cache_dtype, dtype)


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks fit in ``budget_bytes``."""
    return budget_bytes // (block_size * bytes_per_token)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device,
                       kv_cache_dtype: str = "auto") -> list[tuple[KVCache, KVCache]]:
    """Per layer, K and V pools of logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]``:
    plain ``dtype`` tensors for ``auto``, else :class:`QuantizedKVCache` pools."""
    if kv_cache_dtype != "auto":
        return [tuple(QuantizedKVCache.allocate(num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype,
                                                dtype, device) for _ in range(2))
                for _ in range(num_layers)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
