"""The block map: a compact picture of the whole KV pool, made by the core for the dashboard.

One snapshot holds, per physical block, its state (free / owned by one sequence / shared by
several / free but still holding a reusable cached prefix), an owner id to colour it by (the
sequence's id, or the root of the cached prefix chain) and its reference count, as numpy arrays
packed to bytes, plus the list of requests with their tokens, blocks, state and priority.

Cost is the point: the core builds a snapshot on its own loop, so :class:`BlockMapFeed` makes one
only while someone watches, at most ``max_hz`` times a second, and never more often than keeps
its measured build time under ``cpu_share`` of the loop's time (a 100k-block pool takes a few
milliseconds to walk, so it is sampled about once a second, a 1k-block pool ten times). A
snapshot identical to the previous one is not sent. Deltas are the front end's business: it diffs
consecutive snapshots off the step loop (pagedserve.server.dashboard).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from pagedserve.engine.sequence import Sequence
from pagedserve.kv.block_manager import ROOT_CONTENT_ID

if TYPE_CHECKING:
    from pagedserve.engine.core import EngineCore

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


def _listed(seq: Sequence, state: str, num_blocks: int) -> BlockMapRequest:
    return BlockMapRequest(seq.request.request_id, seq.index, seq.seq_id, state, seq.priority, seq.num_tokens,
                           seq.num_computed_tokens, num_blocks, seq.num_preemptions)


def build_block_map(core: EngineCore, version: int = 0) -> BlockMap:
    """Walk the block tables and the prefix cache (O(used + cached blocks)) into a :class:`BlockMap`."""
    t0 = time.perf_counter()
    bm, sched = core.block_manager, core.scheduler
    n = bm.num_blocks
    owner = np.full(n, -1, np.int32)
    refs = np.zeros(n, np.int64)
    ids: list[int] = []
    owners: list[int] = []
    # every KV group's table where the manager has groups (kv/groups.py: a sequence holds blocks in each)
    tables = bm.held_tables() if hasattr(bm, "held_tables") else bm.tables.items()
    for seq_id, table in tables:  # admission order: a shared block takes its first holder's colour
        ids.extend(b.block_id for b in table)
        owners.extend([seq_id] * len(table))
    if ids:
        held = np.asarray(ids, np.int64)
        np.add.at(refs, held, 1)
        owner[held[::-1]] = np.asarray(owners[::-1], np.int32)  # the last write wins: the first holder
    state = np.where(refs > 1, SHARED, np.where(refs == 1, OWNED, FREE)).astype(np.uint8)
    # Free blocks still in the prefix cache, coloured by the first block of their prefix chain.
    parent_of: dict[int, int] = {}
    cached_free: list = []
    for block in bm.cached_blocks():
        parent_of[block.content_id] = block.cache_key[0]
        if block.ref_count == 0:
            cached_free.append(block)
    root_of: dict[int, int] = {}
    for block in cached_free:
        state[block.block_id] = CACHED
        owner[block.block_id] = _root(block.content_id, parent_of, root_of)
    requests = [_listed(s, "running", len(bm.tables.get(s.seq_id, ()))) for s in sched.running[:MAX_LISTED_REQUESTS]]
    room = MAX_LISTED_REQUESTS - len(requests)
    if room > 0 and sched.waiting:
        waiting = sorted(sched.waiting, key=lambda s: s.sort_key)[:room]
        requests += [_listed(s, "preempted" if s.num_preemptions else "waiting", 0) for s in waiting]
    return BlockMap(version, time.time(), n, bm.block_size, state.tobytes(), owner.astype("<i4").tobytes(),
                    np.minimum(refs, 255).astype(np.uint8).tobytes(), requests, len(sched.running),
                    len(sched.waiting), sched.num_preemptions, bm.num_evictions, time.perf_counter() - t0)


def _root(content_id: int, parent_of: dict[int, int], root_of: dict[int, int]) -> int:
    """The content id of the first block of ``content_id``'s prefix chain (memoized in ``root_of``)."""
    path = []
    node = content_id
    while node not in root_of:
        parent = parent_of.get(node, ROOT_CONTENT_ID)
        path.append(node)
        if parent == ROOT_CONTENT_ID or parent not in parent_of:  # a chain root, or its parent was evicted
            root_of[node] = node
            break
        node = parent
    root = root_of[node]
    for visited in path:
        root_of[visited] = root
    return root


class BlockMapFeed:
    """Decides when the core makes a snapshot: only while watched, rate- and cost-bounded, only on change.

    Owned by the loop that steps the core (the step thread, or the core process's loop).
    """

    def __init__(self, max_hz: float = 10.0, cpu_share: float = 0.01):
        self.max_hz = max_hz
        self.cpu_share = cpu_share
        self.watching = False
        self._next_at = 0.0
        self._due = False  # a snapshot is owed regardless of the rate (watching just started)
        self._version = 0
        self._last: BlockMap | None = None

    def watch(self, on: bool) -> None:
        self.watching = on
        self._due = on
        if not on:
            self._last = None  # the next watcher gets a fresh snapshot even if nothing changed

    def maybe_build(self, core: EngineCore, now: float, idle: bool = False) -> BlockMap | None:
        """A new snapshot if one is due now (``idle``: the core just ran out of work, so the final
        state goes out at once), else None."""
        if not self.watching or not (self._due or idle or now >= self._next_at):
            return None
        snap = build_block_map(core, self._version + 1)
        # Spend at most cpu_share of the loop's time on snapshots, and no more than max_hz of them.
        self._next_at = now + max(1.0 / self.max_hz, snap.build_s / self.cpu_share)
        last, forced = self._last, self._due
        self._due = False
        if not forced and last is not None and (last.state, last.owner, last.refs, last.requests,
                                                last.num_evictions) == (snap.state, snap.owner, snap.refs,
                                                                        snap.requests, snap.num_evictions):
            return None
        self._version += 1
        self._last = snap
        return snap
