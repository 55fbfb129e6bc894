"""In-process token buckets: the default backend, exact within one gateway process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pagedserve.gateway.limiter import Bucket, Grant, Limiter, retry_after


class MemoryLimiter(Limiter):
    """Buckets in a dict, refilled by ``clock`` (monotonic seconds) and guarded by one lock.

    The lock is a thread lock (not an asyncio one) so the buckets stay exact when several threads
    share a limiter; each operation is a few arithmetic steps, so it never blocks the event loop.
    Buckets idle long enough to have refilled completely are dropped now and then (they equal a
    fresh bucket), so idle keys do not accumulate.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, sweep_every: int = 10_000):
        self._clock = clock
        self._levels: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._full_at: dict[str, float] = {}  # key -> when the bucket will be full again
        self._lock = threading.Lock()
        self._sweep_every = sweep_every
        self._ops = 0

    def _refill(self, bucket: Bucket, now: float) -> float:
        tokens, ts = self._levels.get(bucket.key, (bucket.burst, now))
        return min(bucket.burst, tokens + max(0.0, now - ts) * bucket.rate)

    def _store(self, bucket: Bucket, level: float, now: float) -> None:
        self._levels[bucket.key] = (level, now)
        missing = bucket.burst - level
        self._full_at[bucket.key] = now + (missing / bucket.rate if bucket.rate > 0 else float("inf"))
        self._ops += 1
        if self._ops % self._sweep_every == 0:
            # Drop buckets that are full again (they equal a fresh one); rare, under the lock.
            for k in [k for k, t in self._full_at.items() if t <= now]:
                del self._levels[k], self._full_at[k]

    async def acquire(self, bucket: Bucket, cost: float) -> Grant:
        """Refill, then take ``cost`` if available (see :meth:`Limiter.acquire`)."""
        with self._lock:
            now = self._clock()
            level = self._refill(bucket, now)
            allowed = cost <= level
            if allowed:
                level -= cost
            self._store(bucket, level, now)
        return Grant(allowed, level, 0.0 if allowed else retry_after(level, cost, bucket))

    async def adjust(self, bucket: Bucket, delta: float) -> float:
        """Add ``delta``, capped at ``burst`` (see :meth:`Limiter.adjust`)."""
        with self._lock:
            now = self._clock()
            level = min(bucket.burst, self._refill(bucket, now) + delta)
            self._store(bucket, level, now)
        return level

    async def peek(self, bucket: Bucket) -> float:
        """The level after refill, taking nothing."""
        with self._lock:
            return self._refill(bucket, self._clock())

    def state(self, key: str) -> tuple[float, float] | None:
        """The stored ``(tokens, last refill time)`` of bucket ``key`` (for inspection and tests)."""
        with self._lock:
            return self._levels.get(key)
