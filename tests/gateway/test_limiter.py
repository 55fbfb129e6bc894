"""The token buckets under contention: 8 workers × many concurrent requests on one bucket.

The Redis backend is hammered from 8 *processes* (the case it exists for); the in-process backend
from 8 threads sharing one limiter. Either way the workers are released together by a barrier.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from pagedserve.gateway.breaker import CircuitBreaker
from pagedserve.gateway.limiter import Bucket, Limiter, Reservation
from pagedserve.gateway.limiter_memory import MemoryLimiter
from pagedserve.gateway.limiter_redis import RedisLimiter

WORKERS = 8


def run_parallel(kind: str, fn: Callable[[Any, int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(barrier, index)`` in 8 processes (redis) or 8 threads (memory); return the results."""
    results: dict[int, Any] = {}
    if kind == "redis":
        ctx = mp.get_context("fork")
        barrier, out = ctx.Barrier(WORKERS, timeout=timeout), ctx.Queue()

        def child(i: int) -> None:
            try:
                out.put((i, fn(barrier, i)))
            except BaseException as e:  # report, don't hang the parent
                out.put((i, RuntimeError(repr(e))))

        procs = [ctx.Process(target=child, args=(i,)) for i in range(WORKERS)]
        for p in procs:
            p.start()
        try:
            for _ in procs:
                i, r = out.get(timeout=timeout)
                results[i] = r
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    else:
        tbarrier, tout = threading.Barrier(WORKERS, timeout=timeout), queue.Queue()

        def thread(i: int) -> None:
            try:
                tout.put((i, fn(tbarrier, i)))
            except BaseException as e:
                tout.put((i, RuntimeError(repr(e))))

        threads = [threading.Thread(target=thread, args=(i,)) for i in range(WORKERS)]
        for t in threads:
            t.start()
        for _ in threads:
            i, r = tout.get(timeout=timeout)
            results[i] = r
        for t in threads:
            t.join(timeout=10)
    for r in results.values():
        if isinstance(r, Exception):
            raise r
    return [results[i] for i in range(WORKERS)]


class Store:
    """Makes a limiter per worker (Redis) or shares one (memory) and reads a bucket's raw state."""

    def __init__(self, kind: str, url: str | None):
        self.kind, self.url = kind, url
        self.memory = MemoryLimiter()

    def make(self) -> Limiter:
        # Generous timeouts: these tests are about exactness under contention, not about a slow Redis
        # (test_limiter_faults covers that), and the machine may be busy.
        return RedisLimiter(self.url, timeout_s=10.0, breaker=CircuitBreaker(100, 0.1)) \
            if self.kind == "redis" else self.memory

    def state(self, key: str) -> tuple[float, float]:
        if self.kind == "redis":
            r = redis.Redis.from_url(self.url)
            tokens, ts = r.hmget("pagedserve:bucket:" + key, "tokens", "ts")
            r.close()
            return float(tokens), float(ts)
        st = self.memory.state(key)
        assert st is not None
        return st


@pytest.fixture(params=["redis", "memory"])
def store(request: pytest.FixtureRequest) -> Store:
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    return Store(request.param, url)


def _uid(name: str) -> str:
    return f"{name}:{random.getrandbits(48):x}"


def test_concurrent_acquire_admits_exactly_the_bucket(store: Store) -> None:
    """No refill: 8 × 60 weighted requests race for 5,000 tokens; admitted + left == 5,000 exactly."""
    bucket = Bucket(_uid("exact"), rate=0.0, burst=5000.0)
    rng = random.Random(0)
    costs = [[rng.randint(1, 40) for _ in range(60)] for _ in range(WORKERS)]

    def worker(barrier: Any, i: int) -> list[tuple[int, bool]]:
        async def main() -> list[tuple[int, bool]]:
            lim = store.make()
            await lim.peek(bucket)  # connect before the race
            barrier.wait()
            grants = await asyncio.gather(*(lim.acquire(bucket, c) for c in costs[i]))
            if store.kind == "redis":
                await lim.close()
            return [(c, g.allowed) for c, g in zip(costs[i], grants)]
        return asyncio.run(main())

    outcomes = [o for w in run_parallel(store.kind, worker) for o in w]
    admitted = sum(c for c, ok in outcomes if ok)
    denied = [c for c, ok in outcomes if not ok]
    level, _ = store.state(bucket.key)
    assert sum(sum(c) for c in costs) > bucket.burst  # the race is over-subscribed
    assert denied, "some requests must be refused"
    assert level >= 0
    assert admitted + level == bucket.burst  # no overshoot, no lost tokens
    # With no refill the level only falls, so every refusal was for more than what is left now.
    assert min(denied) > level


def test_concurrent_acquire_with_refill_matches_elapsed_time(store: Store) -> None:
    """With refill: admitted tokens == refill over the store's own elapsed time − what is left."""
    bucket = Bucket(_uid("refill"), rate=400.0, burst=4000.0)
    run_s = 0.8

    async def drain() -> None:
        lim = store.make()
        assert (await lim.acquire(bucket, bucket.burst)).allowed
        if store.kind == "redis":
            await lim.close()
    asyncio.run(drain())
    start_tokens, start_ts = store.state(bucket.key)

    def worker(barrier: Any, i: int) -> int:
        async def main() -> int:
            lim = store.make()
            await lim.peek(bucket)
            barrier.wait()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + run_s

            async def task() -> int:
                n = 0
                while loop.time() < deadline:
                    if (await lim.acquire(bucket, 1)).allowed:
                        n += 1
                    else:
                        await asyncio.sleep(0.002)
                return n
            counts = await asyncio.gather(*(task() for _ in range(8)))
            if store.kind == "redis":
                await lim.close()
            return sum(counts)
        return asyncio.run(main())

    admitted = sum(run_parallel(store.kind, worker))
    end_tokens, end_ts = store.state(bucket.key)
    assert start_tokens == 0.0
    assert admitted > 0
    assert end_tokens >= 0
    expected = start_tokens + bucket.rate * (end_ts - start_ts) - admitted
    assert end_tokens == pytest.approx(expected, abs=1e-6)


def test_reconcile_returns_unused_tokens_exactly_once(store: Store) -> None:
    """Reserve, then settle on success, failure or disconnect — settle twice; the level stays exact."""
    bucket = Bucket(_uid("reconcile"), rate=0.0, burst=8000.0)

    def worker(barrier: Any, i: int) -> float:
        rng = random.Random(i)

        async def main() -> float:
            lim = store.make()
            await lim.peek(bucket)
            barrier.wait()

            async def request(k: int) -> float:
                cost = rng.randint(10, 60)
                g = await lim.acquire(bucket, cost)
                if not g.allowed:
                    return 0.0
                res = Reservation(lim, bucket, cost)
                actual = float(rng.randint(0, cost))
                outcome = k % 3
                try:
                    if outcome == 1:  # the backend failed before any output
                        actual = 0.0
                        raise ConnectionError("backend failed")
                    if outcome == 2:  # the client went away mid-stream
                        raise asyncio.CancelledError
                    await asyncio.sleep(0)
                    await res.settle(actual)
                except (ConnectionError, asyncio.CancelledError):
                    await res.settle(actual)
                finally:
                    await res.settle(actual)  # the safety net must not refund again
                assert res.settled_with == actual
                return actual

            used = await asyncio.gather(*(request(k) for k in range(40)))
            if store.kind == "redis":
                await lim.close()
            return sum(used)
        return asyncio.run(main())

    used = sum(run_parallel(store.kind, worker))
    level, _ = store.state(bucket.key)
    assert used > 0
    assert level == bucket.burst - used


def test_adjust_never_exceeds_burst(store: Store) -> None:
    """A refund larger than what was taken stops at the bucket's size."""
    bucket = Bucket(_uid("cap"), rate=1.0, burst=100.0)

    async def main() -> None:
        lim = store.make()
        assert (await lim.acquire(bucket, 30)).allowed
        assert await lim.adjust(bucket, 500) == 100.0
        g = await lim.acquire(bucket, 101)
        assert not g.allowed and g.retry_after_s == float("inf")
        g = await lim.acquire(bucket, 100)
        assert g.allowed
        g = await lim.acquire(bucket, 10)
        assert not g.allowed and 8.0 < g.retry_after_s <= 10.0  # computed from the real refill rate
        if store.kind == "redis":
            await lim.close()
    asyncio.run(main())


def test_redis_keys_expire_when_idle(redis_server: Any) -> None:
    """A bucket's key lives only until it would be full again (plus a second)."""
    bucket = Bucket(_uid("ttl"), rate=100.0, burst=1000.0)

    async def main() -> None:
        lim = RedisLimiter(redis_server.url)
        await lim.acquire(bucket, 500)
        await lim.close()
    asyncio.run(main())
    r = redis.Redis.from_url(redis_server.url)
    ttl = r.pttl("pagedserve:bucket:" + bucket.key)
    r.close()
    assert 4000 < ttl <= 6000  # 500 tokens at 100/s = 5 s, + 1 s


def test_memory_buckets_are_dropped_once_full_again() -> None:
    """Idle in-process buckets do not accumulate: once refilled they are swept (and equal a fresh one)."""
    now = [0.0]
    lim = MemoryLimiter(clock=lambda: now[0], sweep_every=1)
    a, b = Bucket("a", rate=10.0, burst=100.0), Bucket("b", rate=10.0, burst=100.0)

    async def main() -> None:
        assert (await lim.acquire(a, 50)).allowed
        now[0] = 4.0  # a is at 90: not full yet
        await lim.acquire(b, 1)
        assert lim.state("a") is not None
        now[0] = 5.5  # a is full again
        await lim.acquire(b, 1)
        assert lim.state("a") is None
        assert await lim.peek(a) == 100.0
    asyncio.run(main())
