r"""KV layer groups: sliding-window layers that give their old blocks back, in one shared pool.

A model whose layers mix full attention and sliding windows (Gemma 3: 3 global, 15 window-512
layers) needs a different number of blocks per layer kind: a window layer never reads a key more
than ``window`` positions back. Following vLLM's hybrid KV cache manager, the layers are split into
**groups of equal size** ``S`` (the gcd of the kinds' layer counts: Gemma 3 270M → one full group
and five window groups of 3 layers), each group with its own block table per sequence, all drawing
from **one pool** of blocks that each hold ``S`` layers' K and V for ``block_size`` tokens::

    pool slot j (j < S): K, V tensors [num_blocks, block_size, kv_heads, head_dim]
    group g's layer at position j in the group reads and writes pool slot j, at its own block ids

    full group   table: [ 7 ][ 3 ][ 12 ][ 20 ][ 21 ]      every block of the context
    window group table: [ 0 ][ 0 ][  5 ][  9 ][ 14 ]      0 = the null block: given back

A block belongs to one group at a time, so the pool adapts to the mix of requests with no split
fixed in advance. After each step a window group gives back (:meth:`GroupedBlockManager.
cache_full_blocks`) the blocks wholly before its next query's window; a sequence then holds at
most :func:`~pagedserve.kv.sizing.window_blocks` blocks per window group (plus, transiently, a
prompt chunk's). Given-back blocks stay in the prefix cache (free, evictable) like a finished
sequence's.

Prefix caching keys each group's blocks apart (the group index joins the first block's extra key).
A hit is the longest prefix cached in **every** group: conservative for window groups, which only
need the blocks of the window before the hit's end (vLLM searches for exactly that; here a hit
whose early window blocks were evicted is a miss, computed again, never wrong).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence as Seq
from dataclasses import dataclass
from operator import attrgetter

from pagedserve.kv.block_manager import BlockManager, KVBlock
from pagedserve.kv.events import KVEventLog
from pagedserve.kv.sizing import window_blocks


@dataclass(frozen=True)
class KVGroup:
    """Layers that share block tables: their attention ``window`` (None: full) and layer indices."""

    window: int | None
    layers: tuple[int, ...]


def kv_groups(layer_windows: Seq[int | None]) -> list[KVGroup]:
    """The layers split into groups of one attention kind and equal size (the gcd of the kinds'
    counts), full attention first, each kind's layers in order."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in sorted(enumerate(layer_windows), key=lambda iw: (iw[1] is not None, iw[0])):
        kinds.setdefault(w, []).append(i)
    if not kinds:
        raise ValueError("a model with no layers has no KV groups")
    size = math.gcd(*(len(v) for v in kinds.values()))
    return [KVGroup(w, tuple(layers[i:i + size])) for w, layers in kinds.items() for i in range(0, len(layers), size)]


def layer_slots(groups: Seq[KVGroup]) -> list[tuple[int, int]]:
    """Per layer, ``(group index, pool slot)``: the slot is the layer's position in its group."""
    slots = {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layers)}
    return [slots[i] for i in range(len(slots))]


class GroupedBlockManager:
    """The :class:`BlockManager` interface the scheduler calls, fanned out to a table per sequence and
    group over one pool: group ``g``'s table for sequence ``s`` is the inner manager's ``s * G + g``.
    ``max_chunk_tokens``: the most tokens one step computes for a sequence (a prompt chunk), which
    a window group holds on top of its window while computing it. What the inner manager answers
    for the whole pool is asked of it as it is (the properties set below the class)."""

    def __init__(self, num_blocks: int, block_size: int, groups: Seq[KVGroup], enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, max_chunk_tokens: int = 0):
        self.groups = list(groups)
        self.inner = BlockManager(num_blocks, block_size, enable_prefix_caching, events, null_block=True)
        self.block_size = block_size
        self.max_chunk_tokens = max_chunk_tokens
        # per block: the group whose table took it last (a block belongs to one group at a time, and
        # its cached content keeps that group's key until it is reused): the block map's colours
        self._group_of = bytearray(num_blocks)

    def _key(self, seq_id: int, group: int) -> int:
        return seq_id * len(self.groups) + group

    @property
    def tables(self) -> dict[int, list[KVBlock]]:
        """Each sequence's first group's table (a full group's when the model has one: no null
        entries, so its length counts the sequence's slots, as the scheduler reads it)."""
        return {seq_id: table for seq_id, group, table in self.group_tables() if group == 0}

    def group_tables(self) -> Iterable[tuple[int, int, list[KVBlock]]]:
        """``(seq_id, group, table)`` for every table (the block map's owners)."""
        n = len(self.groups)
        return ((key // n, key % n, table) for key, table in self.inner.tables.items())

    def held_tables(self) -> Iterable[tuple[int, list[KVBlock]]]:
        """``(seq_id, blocks)`` for every group's table, the null block left out: what each
        sequence holds (the block map's owners)."""
        null = self.inner.null_block
        return ((s, [b for b in table if b is not null]) for s, _, table in self.group_tables())

    def block_groups(self) -> bytes:
        """Per block, the index of the group whose table took it last: the group of every held or
        cached block (a free block's entry is stale)."""
        return bytes(self._group_of)

    def block_ids(self, seq_id: int, group: int = 0) -> list[int]:
        return self.inner.block_ids(self._key(seq_id, group))

    def tokens_in_use(self, sequences: Iterable[tuple[int, int]]) -> int:
        """:meth:`BlockManager.tokens_in_use` over each sequence's first group's table."""
        return self.inner.tokens_in_use((self._key(seq_id, 0), computed) for seq_id, computed in sequences)

    def num_blocks_for(self, num_tokens: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds at once, over all groups."""
        blocks = self.inner.num_blocks_for(num_tokens)
        chunk = self.inner.num_blocks_for(self.max_chunk_tokens) + 1
        return sum(blocks if g.window is None else min(blocks, window_blocks(g.window, self.block_size) + chunk)
                   for g in self.groups)

    # ---- per group -----------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Seq[int], extra: Hashable = None) -> list[tuple[KVBlock, ...]]:
        """The leading blocks cached in every group: one tuple (a block per group) per block index."""
        hits = [self.inner.find_cached_prefix(token_ids, (extra, g)) for g in range(len(self.groups))]
        return list(zip(*hits))

    def allocate(self, seq_id: int, num_tokens: int, cached_prefix: Seq[tuple[KVBlock, ...]] = (),
                 num_computed_tokens: int = 0, reserve: int = 0) -> bool:
        """Every group's table made to cover ``num_tokens`` slots, or (False) none changed."""
        per_group = [[hit[g] for hit in cached_prefix] for g in range(len(self.groups))]
        keys = [self._key(seq_id, g) for g in range(len(self.groups))]
        need = sum(self.inner.blocks_needed(k, num_tokens, p, num_computed_tokens) for k, p in zip(keys, per_group))
        if need + reserve > self.inner.num_free_blocks:
            return False
        for g, (k, p) in enumerate(zip(keys, per_group)):
            # blocks from here on may be new: appended, or a copy-on-write copy of the last held one
            first_new = min(len(self.inner.tables.get(k, ())), num_computed_tokens // self.block_size)
            ok = self.inner.allocate(k, num_tokens, p, num_computed_tokens)
            assert ok, "a group could not allocate after the pool said it could"
            for block in self.inner.tables[k][first_new:]:
                self._group_of[block.block_id] = g
        return True

    def cache_full_blocks(self, seq_id: int, token_ids: Seq[int], num_computed_tokens: int,
                          extra: Hashable = None) -> None:
        """Register full blocks in every group, then give back each window group's blocks that
        the next query (at position ``num_computed_tokens``) no longer sees: it sees keys from
        position ``num_computed_tokens - window + 1``, so blocks before that one's go."""
        for g, group in enumerate(self.groups):
            key = self._key(seq_id, g)
            self.inner.cache_full_blocks(key, token_ids, num_computed_tokens, (extra, g))
            if group.window is not None:
                self.inner.release_leading(key, max(0, num_computed_tokens - group.window + 1) // self.block_size)

    def fork(self, parent_id: int, child_id: int) -> None:
        for g in range(len(self.groups)):
            self.inner.fork(self._key(parent_id, g), self._key(child_id, g))

    def free(self, seq_id: int) -> None:
        for g in range(len(self.groups)):
            self.inner.free(self._key(seq_id, g))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        for g in range(len(self.groups)):
            self.inner.truncate(self._key(seq_id, g), num_tokens)


# What the BlockManager answers for the whole pool, asked of the inner manager as it is: each a
# property, named, not forwarded by __getattr__, which cost the scheduler's hot calls a failed lookup first.
for _name in ("num_blocks", "enable_prefix_caching", "events", "blocks", "num_free_blocks", "num_used_blocks",
              "num_cached_free_blocks", "num_evictions", "prefix_queried_tokens", "prefix_hit_tokens",
              "cached_block_hashes", "cached_blocks", "record_prefix_lookup", "reset_prefix_cache",
              "take_pending_copies", "check_invariants"):
    setattr(GroupedBlockManager, _name, property(attrgetter(f"inner.{_name}")))
