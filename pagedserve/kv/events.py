"""KV block events in vLLM's wire layout: what entered and left the prefix cache, for routers.

A router that scores replicas by how much of a prompt each has cached (llm-d's precise prefix
scorer, AIBrix, Dynamo's KV router) follows each replica's cache through these events instead of
guessing. The structs are vLLM's (``vllm/distributed/kv_events.py``): msgspec ``array_like`` structs,
the events a tagged union whose tag is the class name, so one event encodes as a msgpack array
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``
and a batch as ``[ts, [event, ...], data_parallel_rank]``. Decoders ignore trailing fields they do
not know, so vLLM's older and newer subscribers both read them.

Block hashes are 64-bit content hashes, the same on every replica and across restarts: the first 8
bytes (big-endian, unsigned) of SHA-256 over the msgpack array ``[parent_hash, token_ids, extra]``,
where ``parent_hash`` is the previous block's hash (nil for a prompt's first block), ``token_ids`` the
block's ``block_size`` tokens and ``extra`` the first block's isolation key (KV dtype and the request's
``cache_salt``; nil on later blocks). The block manager's own prefix-cache key is the exact tuple
(parent content id, token ids, extra); the hash is derived from the same content, so equal keys give
equal hashes. Two cache entries can carry one hash (a prefix cached again after its parent was
evicted), so :class:`KVEventLog` counts entries per hash and reports a hash stored when its first
entry appears and removed when its last one goes: a subscriber's set of hashes is exactly the set of
distinct hashes in the cache (:meth:`BlockManager.cached_block_hashes`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

import msgspec

# vLLM's medium for the engine's own KV pool ("GPU"), used whatever the device: routers weigh
# offloaded tiers ("CPU", disk) below it, and this pool is the primary one.
MEDIUM = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall-clock time (time.time()) the batch was made
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; ``tag=True`` makes the class name the union's tag."""


class BlockStored(KVCacheEvent):
    """A chain of full blocks entered the cache: ``block_hashes[i]``'s parent is ``block_hashes[i-1]``,
    the first one's is ``parent_block_hash``; ``token_ids`` holds all their tokens in order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # no default: always encoded, as vLLM's newer decoders require


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    """The type a subscriber decodes a payload as."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()


def block_hash(parent: int | None, token_ids: Sequence[int], extra: Hashable) -> int:
    """The content hash of one full block (see the module docstring)."""
    try:
        data = _ENCODER.encode([parent, list(token_ids), extra])
    except TypeError:  # an isolation key msgpack cannot encode: its repr is deterministic too
        data = _ENCODER.encode([parent, list(token_ids), repr(extra)])
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class KVEventLog:
    """The events one engine step caused, in order; the block manager writes, the core takes them.
    Adjacent events merge, as vLLM sends them: a chain's stored blocks, consecutive removals."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._entries: dict[int, int] = {}  # hash -> cache entries carrying it
        self._pending: list[KVCacheEvent] = []

    def stored(self, h: int, parent: int | None, token_ids: Sequence[int]) -> None:
        count = self._entries.get(h, 0)
        self._entries[h] = count + 1
        if count:
            return  # already known to subscribers
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(h)
            last.token_ids.extend(token_ids)
        else:
            self._pending.append(BlockStored([h], parent, list(token_ids), self.block_size, None, MEDIUM, None))

    def removed(self, h: int) -> None:
        count = self._entries[h] - 1
        if count:
            self._entries[h] = count
            return
        del self._entries[h]
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(h)
        else:
            self._pending.append(BlockRemoved([h], MEDIUM))

    def cleared(self) -> None:
        """The cache is empty: one ``AllBlocksCleared`` replaces whatever this step said before."""
        self._entries.clear()
        self._pending = [AllBlocksCleared()]

    def hashes(self) -> frozenset[int]:
        return frozenset(self._entries)

    def take(self) -> list[KVCacheEvent]:
        events, self._pending = self._pending, []
        return events
