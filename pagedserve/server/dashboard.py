"""The engine dashboard's live feed: ``GET /dashboard/events``, server-sent events.

```
 core (its loop)                      server event loop (this module)               browser
 BlockMapFeed: snapshot ≤10 Hz,  ──▶  client.block_map ──▶ per viewer: full on    ──▶ grid, request
 ≤1% of its time, on change only      (latest only)        connect, then deltas       list, events
                                      client.stats() ────▶ "stats" event, 4 Hz    ──▶ time series
```

The core makes snapshots only while at least one viewer is connected (the first one turns them
on, the last one off). Each viewer's stream is pulled by its connection: a slow browser simply
skips snapshots and gets the difference to the last one it saw, so nobody queues without bound.
Deltas and encodings are computed once per snapshot pair and shared by all viewers.

Events (one JSON object each): ``full`` (the whole pool, base64 arrays), ``delta`` (changed block
indices and their new values), ``stats`` (load, KV utilisation against worst-case reservation,
counters). A pool shared by KV groups (Gemma 3's full-attention and sliding-window layers) marks
each block's group in the upper bits of its state byte
(:mod:`pagedserve.engine.core.block_map_feed`): the bytes go to the page as they are, which unpacks
them; a one-table pool's are plain states. A reconnecting browser gets a ``full`` again, so a restarted server is picked up.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator

import msgspec
import numpy as np

from pagedserve.engine.block_map import BlockMap
from pagedserve.engine import EngineClient
from pagedserve.web import SSE_PING, SSE_PREAMBLE, StopCheck, sse_event

TICK_S = 0.1  # how often a viewer's stream looks for a new snapshot
STATS_INTERVAL_S = 0.25
PING_INTERVAL_S = 15.0
MAX_VIEWERS = 16  # each costs a connection and some encoding; more get 503


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


def _arrays(snap: BlockMap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.frombuffer(snap.state, np.uint8), np.frombuffer(snap.owner, "<i4"),
            np.frombuffer(snap.refs, np.uint8))


def _meta(snap: BlockMap) -> dict:
    return {"version": snap.version, "wall_time": snap.wall_time, "num_blocks": snap.num_blocks,
            "block_size": snap.block_size, "num_running": snap.num_running, "num_waiting": snap.num_waiting,
            "num_preemptions": snap.num_preemptions, "num_evictions": snap.num_evictions,
            "build_ms": round(snap.build_s * 1000, 3),
            "requests": [msgspec.structs.asdict(r) for r in snap.requests]}


class DashboardFeed:
    """Fans the client's block-map snapshots and stats out to the connected viewers."""

    def __init__(self, client: EngineClient, model_name: str, max_viewers: int = MAX_VIEWERS):
        self.client = client
        self.model_name = model_name
        self.max_viewers = max_viewers
        self.viewers = 0
        # The serving CLI points this at uvicorn's exit flag: open feeds end when shutdown starts
        # (uvicorn waits for open responses before it stops, and a feed never ends by itself).
        self.should_stop: StopCheck = lambda: False
        self._full: tuple[int, bytes] | None = None  # (version, encoded event) of the latest snapshot
        self._delta: tuple[int, int, bytes] | None = None  # (from version, to version, encoded event)
        self._stats: tuple[float, bytes] | None = None

    @property
    def full(self) -> bool:
        return self.viewers >= self.max_viewers

    # ---- encodings, shared by every viewer -------------------------------------------------

    def _full_event(self, snap: BlockMap) -> bytes:
        if self._full is None or self._full[0] != snap.version:
            state, owner, refs = _arrays(snap)
            body = {**_meta(snap), "state": _b64(state), "owner": _b64(owner), "refs": _b64(refs)}
            self._full = (snap.version, sse_event("full", json.dumps(body, separators=(",", ":"))))
        return self._full[1]

    def _delta_event(self, old: BlockMap, new: BlockMap) -> bytes:
        if self._delta is not None and self._delta[:2] == (old.version, new.version):
            return self._delta[2]
        if old.num_blocks != new.num_blocks:
            return self._full_event(new)
        (s0, o0, r0), (s1, o1, r1) = _arrays(old), _arrays(new)
        changed = np.flatnonzero((s0 != s1) | (o0 != o1) | (r0 != r1)).astype("<i4")
        if len(changed) * 10 > new.num_blocks * 6:  # (4 + 1 + 4 + 1 bytes each) more than a full one
            event = self._full_event(new)
        else:
            body = {**_meta(new), "from_version": old.version, "index": _b64(changed),
                    "state": _b64(s1[changed]), "owner": _b64(o1[changed]), "refs": _b64(r1[changed])}
            event = sse_event("delta", json.dumps(body, separators=(",", ":")))
        self._delta = (old.version, new.version, event)
        return event

    def _stats_event(self, now: float) -> bytes:
        if self._stats is None or now - self._stats[0] >= STATS_INTERVAL_S / 2:
            s = self.client.stats()
            load = self.client.load()
            body = {
                "wall_time": time.time(), "model": self.model_name, "running": s.num_running,
                "waiting": s.num_waiting, "max_num_seqs": s.max_num_seqs, "max_model_len": s.max_model_len,
                "block_size": s.block_size, "kv_blocks_total": s.kv_blocks_total, "kv_blocks_used": s.kv_blocks_used,
                "kv_blocks_cached": s.kv_blocks_cached_free, "kv_tokens_in_use": s.kv_tokens_in_use,
                "kv_slots_allocated": s.kv_slots_allocated, "naive_reserved_tokens": s.naive_reserved_tokens,
                "kv_utilization": s.kv_utilization,
                # the same tokens in a worst-case reservation of max_model_len slots per running request
                "naive_utilization": s.kv_tokens_in_use / s.naive_reserved_tokens if s.naive_reserved_tokens else 0.0,
                "preemptions": s.num_preemptions, "prefix_queried_tokens": s.prefix_queried_tokens,
                "prefix_hit_tokens": s.prefix_hit_tokens, "generation_tokens": s.generation_tokens,
                "tokens_per_s": load.tokens_per_s, "est_queue_wait_s": load.est_queue_wait_s,
            }
            self._stats = (now, sse_event("stats", json.dumps(body, separators=(",", ":"))))
        return self._stats[1]

    # ---- one viewer ------------------------------------------------------------------------

    def _join(self) -> None:
        self.viewers += 1
        if self.viewers == 1:
            self.client.watch_block_map(True)

    def _leave(self) -> None:
        self.viewers -= 1
        if self.viewers == 0:
            self.client.watch_block_map(False)  # the client drops its snapshot: the next viewer waits for a fresh one
            self._full = self._delta = None

    async def events(self) -> AsyncIterator[bytes]:
        """One viewer's event stream, until it disconnects or the server stops."""
        self._join()
        try:
            yield SSE_PREAMBLE
            seen: BlockMap | None = None
            last_stats = last_ping = time.monotonic()
            yield self._stats_event(last_stats)
            while not self.should_stop() and self.client.is_running:
                snap = self.client.block_map
                if snap is not None and snap is not seen:
                    yield self._full_event(snap) if seen is None else self._delta_event(seen, snap)
                    seen = snap
                now = time.monotonic()
                if now - last_stats >= STATS_INTERVAL_S:
                    yield self._stats_event(now)
                    last_stats = now
                if now - last_ping >= PING_INTERVAL_S:
                    yield SSE_PING
                    last_ping = now
                await asyncio.sleep(TICK_S)
        finally:
            self._leave()
