"""The token-bucket interface: reserve before forwarding, reconcile once when the response ends.

A bucket holds at most ``burst`` tokens and refills at ``rate`` tokens per second. A request
*reserves* its worst case (prompt + output cap) with :meth:`Limiter.acquire` before it is sent
on, and when it ends the gateway gives back what it did not use with :meth:`Limiter.adjust`.
Charging only after the response would let one request overshoot the limit by its whole size.

::

    acquire(cost) ──▶ forward ──▶ response ends / fails / client leaves
         │                                   │
         └── Reservation(cost) ──settle(actual)──▶ adjust(cost - actual)   (exactly once)

Backends: :class:`~pagedserve.gateway.limiter_memory.MemoryLimiter` (one process, the default) and
:class:`~pagedserve.gateway.limiter_redis.RedisLimiter` (shared by many gateway processes).
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass


class LimiterUnavailable(Exception):
    """The limiter's store cannot answer (Redis down, hung or its circuit breaker open)."""


@dataclass(frozen=True)
class Bucket:
    """One bucket's identity and shape: ``key`` names it in the store; ``rate`` tokens/s, ``burst`` max."""

    key: str
    rate: float
    burst: float

    def __post_init__(self) -> None:
        if self.rate < 0 or self.burst <= 0:
            raise ValueError(f"bucket {self.key!r}: rate must be >= 0 and burst > 0")


@dataclass(frozen=True)
class Grant:
    """The answer to :meth:`Limiter.acquire`.

    ``remaining`` is the bucket's level after the call (after the take when allowed).
    ``retry_after_s`` is how long until the refill covers the cost (0 when allowed; infinite when
    the cost is larger than the bucket can ever hold or the rate is 0).
    """

    allowed: bool
    remaining: float
    retry_after_s: float


def retry_after(level: float, cost: float, bucket: Bucket) -> float:
    """Seconds until a bucket at ``level`` refills enough to pay ``cost`` (inf if it never will)."""
    if cost <= level:
        return 0.0
    if cost > bucket.burst or bucket.rate <= 0:
        return float("inf")
    return (cost - level) / bucket.rate


class Limiter(abc.ABC):
    """Two operations on a bucket, both atomic in the backend's store."""

    @abc.abstractmethod
    async def acquire(self, bucket: Bucket, cost: float) -> Grant:
        """Refill by elapsed time, then take ``cost`` if the bucket holds it; never partially.

        Raises :class:`LimiterUnavailable` when the store cannot answer in time.
        """

    @abc.abstractmethod
    async def adjust(self, bucket: Bucket, delta: float) -> float:
        """Add ``delta`` tokens (negative charges more), capped at ``burst``; returns the new level.

        Raises :class:`LimiterUnavailable` when the store cannot answer in time.
        """

    @abc.abstractmethod
    async def peek(self, bucket: Bucket) -> float:
        """The bucket's level now (after refill), taking nothing."""

    @property
    def healthy(self) -> bool:
        """False while the store is known to be unreachable (the circuit breaker is open)."""
        return True

    async def close(self) -> None:
        """Release connections."""


class Reservation:
    """Tokens taken for one request; :meth:`settle` gives back the unused part exactly once.

    Every path that ends a request (success, failure, client disconnect) calls ``settle``; only
    the first call reaches the store, so a ``finally`` after an error handler cannot refund twice.
    """

    def __init__(self, limiter: Limiter, bucket: Bucket, cost: float):
        self.limiter = limiter
        self.bucket = bucket
        self.cost = cost
        self.settled_with: float | None = None
        self._lock = asyncio.Lock()

    @property
    def settled(self) -> bool:
        """Whether :meth:`settle` has already run."""
        return self.settled_with is not None

    async def settle(self, actual: float) -> float:
        """Return ``cost - actual`` to the bucket (charge more if ``actual`` exceeds the reservation).

        Returns the delta applied (0 on every call after the first). Store errors propagate after
        the reservation is marked settled: a refund is never retried into a double refund.
        """
        async with self._lock:
            if self.settled_with is not None:
                return 0.0
            self.settled_with = actual
        delta = self.cost - actual
        if delta != 0:
            await self.limiter.adjust(self.bucket, delta)
        return delta
