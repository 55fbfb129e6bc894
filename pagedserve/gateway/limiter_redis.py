"""Token buckets in Redis: one Lua script refills and takes atomically on Redis's own clock.

Many gateway processes share one truth: the script reads ``TIME`` inside Redis, so no process's
clock matters, and a bucket's state is one hash ``{tokens, ts}`` that expires once it would have
refilled completely (an absent key is a full bucket). The script is loaded once (``SCRIPT LOAD``)
and called by its SHA; after a Redis restart (``NOSCRIPT``) it is loaded again.

Short socket timeouts and a :class:`CircuitBreaker` bound how long a request can wait on a dead
or frozen Redis; the caller then applies its tier's fail-open / fail-closed policy. There is no
per-process fallback bucket: that would multiply the limit by the number of processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from pagedserve.gateway.breaker import CircuitBreaker
from pagedserve.gateway.limiter import Bucket, Grant, Limiter, LimiterUnavailable, retry_after

log = logging.getLogger("pagedserve.gateway.limiter")

# KEYS[1] bucket; ARGV: rate, burst, amount, mode ("take" | "add" | "peek").
# Returns {allowed (0/1), level as a string} (Lua numbers would be truncated to integers).
BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local mode = ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
end
local allowed = 1
if mode == 'take' then
  if amount <= tokens then tokens = tokens - amount else allowed = 0 end
elseif mode == 'add' then
  tokens = math.min(burst, tokens + amount)
else
  return {1, string.format('%.17g', tokens)}
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', now))
local ttl = 3600000
if rate > 0 then ttl = math.ceil((burst - math.min(tokens, burst)) / rate * 1000) + 1000 end
redis.call('PEXPIRE', KEYS[1], ttl)
return {allowed, string.format('%.17g', tokens)}
"""


class RedisLimiter(Limiter):
    """Buckets in Redis at ``url``; every call bounded by ``timeout_s`` and a circuit breaker.

    ``on_error`` is called on every failed call (a metrics hook). ``prefix`` namespaces the keys
    (``{prefix}{bucket.key}``). Keys idle until their bucket would be full again expire (a rate-0
    bucket's key lives an hour after its last use).
    """

    def __init__(self, url: str, *, timeout_s: float = 0.25, prefix: str = "pagedserve:bucket:",
                 breaker: CircuitBreaker | None = None, on_error: Callable[[], None] | None = None):
        self.url = url
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.breaker = breaker or CircuitBreaker()
        # No client-side retries: the breaker and the tier's policy decide what a failure means.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._sha: str | None = None
        self.errors = 0
        self._on_error = on_error  # e.g. a metrics counter's inc

    @property
    def healthy(self) -> bool:
        """False while the breaker is open (Redis known unreachable)."""
        return self.breaker.state == "closed"

    async def _eval(self, bucket: Bucket, amount: float, mode: str) -> tuple[bool, float]:
        if not self.breaker.allow():
            raise LimiterUnavailable(f"redis circuit breaker {self.breaker.state} ({self.url})")
        key = self.prefix + bucket.key
        args = (repr(float(bucket.rate)), repr(float(bucket.burst)), repr(float(amount)), mode)
        try:
            # A hard deadline backs up the socket timeout: a frozen Redis must never hang a request.
            async with asyncio.timeout(self.timeout_s * 2):
                if self._sha is None:
                    self._sha = await self._redis.script_load(BUCKET_LUA)
                try:
                    result = await self._redis.evalsha(self._sha, 1, key, *args)
                except NoScriptError:  # Redis restarted and lost its script cache
                    self._sha = await self._redis.script_load(BUCKET_LUA)
                    result = await self._redis.evalsha(self._sha, 1, key, *args)
        except (RedisError, OSError, TimeoutError) as e:
            self.errors += 1
            if self._on_error is not None:
                self._on_error()
            opened = self.breaker.record_failure()
            if opened:
                log.warning("redis limiter unavailable (%s: %s); circuit breaker open for %.1fs",
                            type(e).__name__, e, self.breaker.reset_s)
            # A timed-out connection may hold a half-read reply: drop all pooled connections.
            await self._redis.connection_pool.disconnect(inuse_connections=True)
            raise LimiterUnavailable(f"redis limiter error: {type(e).__name__}: {e}") from e
        if self.breaker.state != "closed" or self.breaker.failures:
            log.info("redis limiter reachable again (%s)", self.url)
        self.breaker.record_success()
        allowed, level = result
        return bool(int(allowed)), float(level)

    async def acquire(self, bucket: Bucket, cost: float) -> Grant:
        """Atomic refill-and-take in Redis (see :meth:`Limiter.acquire`)."""
        allowed, level = await self._eval(bucket, cost, "take")
        return Grant(allowed, level, 0.0 if allowed else retry_after(level, cost, bucket))

    async def adjust(self, bucket: Bucket, delta: float) -> float:
        """Atomic refill-and-add in Redis, capped at ``burst`` (see :meth:`Limiter.adjust`)."""
        _, level = await self._eval(bucket, delta, "add")
        return level

    async def peek(self, bucket: Bucket) -> float:
        """The level after refill; reads without writing."""
        _, level = await self._eval(bucket, 0.0, "peek")
        return level

    async def close(self) -> None:
        """Close the connection pool."""
        await self._redis.aclose()

