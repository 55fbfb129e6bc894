"""The core's side of the block map: walking the allocator into a snapshot, and when to.

See :mod:`pagedserve.engine.block_map` for what a snapshot holds and why its cost is bounded.

A pool shared by KV groups (:mod:`pagedserve.kv.groups`: Gemma 3's full-attention and sliding-window
layers) marks each held or cached block's group in the upper bits of its state byte, so the
snapshot's format stays the one :mod:`~pagedserve.engine.block_map` defines::

    bit  7 6 5 4 3 | 2      | 1 0
         group + 1 | window | FREE / OWNED / CACHED / SHARED

``group + 1`` is 0 for a free block and for every block of a one-table pool (whose snapshots are
byte for byte what they were before groups); group indices past 30 show as 30 (no model here has
that many groups). The dashboard's page unpacks it (``pagedserve/web/static/engine.js``), Python
readers with :func:`split_group_bits`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.engine.block_map import CACHED, FREE, MAX_LISTED_REQUESTS, OWNED, SHARED, BlockMap, BlockMapRequest
from pagedserve.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from pagedserve.engine.core.engine_core import EngineCore


STATE_MASK = 0b11
WINDOW_BIT = 0b100
GROUP_SHIFT = 3
MAX_GROUP_INDEX = 30  # group + 1 fits the 5 upper bits


def split_group_bits(state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(states, groups)`` of a snapshot's state bytes: the plain states, and per block its KV group
    tag ``state >> 2``: 0 for none, else ``(group + 1) << 1 | window`` (module docstring)."""
    return state & STATE_MASK, state >> 2


def _group_bits(bm, state: np.ndarray) -> np.ndarray:
    """The KV group marks for every non-free block of a grouped pool (module docstring)."""
    group = np.minimum(np.frombuffer(bm.block_groups(), np.uint8), MAX_GROUP_INDEX)
    window = np.array([g.window is not None for g in bm.groups][:MAX_GROUP_INDEX + 1], np.uint8)
    marks = ((group + 1) << GROUP_SHIFT) | (window[group] * WINDOW_BIT)
    return np.where(state != FREE, marks, 0).astype(np.uint8)


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
    grouped = hasattr(bm, "held_tables")
    tables = bm.held_tables() if grouped else bm.tables.items()
    held_by: dict[int, int] = {}  # blocks per sequence, over every group
    for seq_id, table in tables:  # admission order: a shared block takes its first holder's colour
        ids.extend(b.block_id for b in table)
        owners.extend([seq_id] * len(table))
        held_by[seq_id] = held_by.get(seq_id, 0) + len(table)
    if ids:
        held = np.asarray(ids, np.int64)
        np.add.at(refs, held, 1)
        owner[held[::-1]] = np.asarray(owners[::-1], np.int32)  # the last write wins: the first holder
    state = np.where(refs > 1, SHARED, np.where(refs == 1, OWNED, FREE)).astype(np.uint8)
    # Free blocks still in the prefix cache, coloured by the first block of their prefix chain.
    parent_of = {block.content_id: block.cache_key[0] for block in bm.cached_blocks()}
    root_of: dict[int, int] = {}
    for block in bm.cached_blocks():
        if block.ref_count == 0:
            state[block.block_id] = CACHED
            owner[block.block_id] = _root(block.content_id, parent_of, root_of)
    if grouped:
        state |= _group_bits(bm, state)
    requests = [_listed(s, "running", held_by.get(s.seq_id, 0)) for s in sched.running[:MAX_LISTED_REQUESTS]]
    room = MAX_LISTED_REQUESTS - len(requests)
    if room > 0 and sched.waiting:
        waiting = sorted(sched.waiting, key=lambda s: s.sort_key)[:room]
        requests += [_listed(s, "preempted" if s.num_preemptions else "waiting", 0) for s in waiting]
    return BlockMap(version, time.time(), n, bm.block_size, state.tobytes(), owner.astype("<i4").tobytes(),
                    np.minimum(refs, 255).astype(np.uint8).tobytes(), requests, len(sched.running),
                    len(sched.waiting), sched.num_preemptions, bm.num_evictions, time.perf_counter() - t0)


def _root(content_id: int, parent_of: dict[int, int], root_of: dict[int, int]) -> int:
    """The content id of the first block of ``content_id``'s prefix chain (memoized in ``root_of``)."""
    path = [content_id]
    # Up the chain to a block whose root is known, or to a chain root: its parent is the root content
    # id (never a cached block's) or was evicted.
    while path[-1] not in root_of and parent_of[path[-1]] in parent_of:
        path.append(parent_of[path[-1]])
    root = root_of.get(path[-1], path[-1])
    root_of.update(dict.fromkeys(path, root))
    return root


class BlockMapFeed:
    """Decides when the core's loop makes a snapshot: only while watched, rate- and cost-bounded,
    only on change."""

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
