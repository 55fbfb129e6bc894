"""KV cache tensors, sized from a memory budget with the planner's bytes-per-token formula."""

from __future__ import annotations

import torch

from pagedserve.planner.sizing import kv_bytes_per_token


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take across all layers, in the cache's element type."""
    return int(kv_bytes_per_token(num_layers, num_kv_heads, head_dim, torch.empty((), dtype=dtype).element_size()))


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks fit in ``budget_bytes``."""
    return budget_bytes // (block_size * bytes_per_token)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V tensors of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
