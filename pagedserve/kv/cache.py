"""KV cache tensors, sized from a memory budget with the planner's bytes-per-token formula."""

from __future__ import annotations

import torch

from pagedserve.kv.int4 import Int4KVCache, TailMap
from pagedserve.kv.quant import QuantizedKVCache
from pagedserve.kv.zeros import zeros


class HeadMajorKVCache:
    """One layer's K (or V) pool in the model dtype, stored head-major: ``[kv_heads, blocks, block_size, head_dim]``.

    Its logical view (``cache[block_ids]``, ``shape``) is the usual ``[blocks, block_size, kv_heads,
    head_dim]``. Stored head-major, the blocks a decode batch gathers come out as one contiguous
    ``[kv_heads, seqs, tokens, head_dim]`` tensor, ready for batched matmuls with no transposing copy
    (on CPU that copy cost more than the gather itself).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.data = zeros((num_kv_heads, num_blocks, block_size, head_dim), dtype, device)  # lazily zeroed on CPU
        self._head_offsets = (torch.arange(num_kv_heads, device=device) * num_blocks).unsqueeze(1)

    @property
    def shape(self) -> torch.Size:
        kvh, nb, bs, hd = self.data.shape
        return torch.Size((nb, bs, kvh, hd))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Store ``x [T, kv_heads, head_dim]``: token i at flat slot ``slot_mapping[i]``."""
        kvh, nb, bs, hd = self.data.shape
        if x.dtype != self.data.dtype:  # a no-op .to() still costs microseconds per layer per step
            x = x.to(self.data.dtype)
        self.data.view(kvh, nb * bs, hd).index_copy_(1, slot_mapping, x.transpose(0, 1))

    def gather_head_major(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` (shape ``S``) as a contiguous ``[kv_heads, *S, block_size, head_dim]``."""
        kvh, nb, bs, hd = self.data.shape
        # Row r of the [kv_heads * blocks, block] view is head r // nb, block r % nb: selecting rows
        # along dim 0 is a plain memcpy per block, much faster than index_select along dim 1.
        ids = block_ids.reshape(1, -1) + self._head_offsets
        rows = self.data.view(kvh * nb, bs * hd).index_select(0, ids.reshape(-1))
        return rows.view(kvh, *block_ids.shape, bs, hd)

    def __getitem__(self, block_ids) -> torch.Tensor:
        """The blocks in the logical layout ``[..., block_size, kv_heads, head_dim]``."""
        return self.data[:, block_ids].movedim(0, -2)

    def __setitem__(self, block_ids, blocks: torch.Tensor) -> None:
        """Overwrite blocks (copy-on-write copies them this way)."""
        self.data[:, block_ids] = blocks.movedim(-2, 0)


KVCache = torch.Tensor | HeadMajorKVCache | QuantizedKVCache | Int4KVCache  # one layer's K (or V) pool


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks fit in ``budget_bytes``."""
    return budget_bytes // (block_size * bytes_per_token)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device,
                       kv_cache_dtype: str = "auto", tail_slots: int | None = None,
                       kv_groups: int = 1, native_ops: object | None = None) -> list[tuple[KVCache, KVCache]]:
    """Per layer, K and V pools of logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    int4's share one :class:`TailMap` of ``tail_slots`` open blocks (default: one per block;
    ``kv_groups``: slot mappings a step writes), keys at 4 bits a channel until a layer's K pool is
    given its own (:meth:`~pagedserve.kv.int4.Int4KVCache.with_key_bits`), and write through
    ``native_ops`` (the loaded kernels' namespace) where given."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == "int4":
        tails = TailMap(num_blocks, block_size, tail_slots or num_blocks, device, kv_groups)
        return [Int4KVCache.allocate_pair(*shape, dtype, device, tails, native_ops) for _ in range(num_layers)]
    if kv_cache_dtype != "auto":
        return [tuple(QuantizedKVCache.allocate(*shape, kv_cache_dtype, dtype, device, native_ops) for _ in range(2))
                for _ in range(num_layers)]
    return [tuple(HeadMajorKVCache(*shape, dtype, device) for _ in range(2)) for _ in range(num_layers)]
