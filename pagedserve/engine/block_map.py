"""The block map: a compact picture of the whole KV pool, made by the core for the dashboard.

One snapshot holds, per physical block, its state (free / owned by one sequence / shared by
several / free but still holding a reusable cached prefix), an owner id to colour it by (the
sequence's id, or the root of the cached prefix chain) and its reference count, as numpy arrays
packed to bytes, plus the list of requests with their tokens, blocks, state and priority.

Cost is the point: the core builds a snapshot on its own loop, so
:class:`~pagedserve.engine.core.block_map_feed.BlockMapFeed` makes one only while someone watches,
at most ``max_hz`` times a second and within ``cpu_share`` of the loop's time (a 100k-block pool
takes a few milliseconds to walk: about once a second), and never sends one unchanged. Deltas are the front end's business: it diffs
consecutive snapshots off the step loop (pagedserve.server.dashboard).

This module holds what crosses to the front end (the snapshot's types, importable without the
core); the core's side that walks the allocator is :mod:`pagedserve.engine.core.block_map_feed`.
"""

from __future__ import annotations

import msgspec

# Per-block states (the uint8 values of BlockMap.state).
FREE, OWNED, CACHED, SHARED = 0, 1, 2, 3
# The request list lists running sequences and the first waiting ones, this many at most.
MAX_LISTED_REQUESTS = 256


class BlockMapRequest(msgspec.Struct, array_like=True, frozen=True):
    """One sequence as the dashboard lists it (``seq_id`` is the owner id of its blocks)."""

    request_id: str
    index: int  # completion index (n > 1)
    seq_id: int
    state: str  # running | waiting | preempted (waiting to be recomputed)
    priority: int
    num_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_preemptions: int


class BlockMap(msgspec.Struct, array_like=True, frozen=True):
    """A snapshot of the pool. ``state``: uint8 per block; ``owner``: int32 little-endian per block
    (a sequence id for OWNED/SHARED, a prefix id for CACHED, -1 for FREE); ``refs``: uint8 per block
    (reference count, clipped at 255)."""

    version: int
    wall_time: float
    num_blocks: int
    block_size: int
    state: bytes
    owner: bytes
    refs: bytes
    requests: list[BlockMapRequest]
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_evictions: int
    build_s: float  # what this snapshot cost the core
