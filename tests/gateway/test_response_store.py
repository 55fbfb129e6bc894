"""The Responses API's store on its own: memory and a real Redis, with expiry, ownership, the
memory store's bound, and a Redis outage reported as such (never as a missing response)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pagedserve.apis.response_store import (MemoryResponseStore, RedisResponseStore, StoreUnavailable, make_store,
                                            owner_of)
from pagedserve.apis.responses_service import ResponsesService

RECORD = {"response": {"id": "resp_1", "output": []}, "input": [{"type": "message", "role": "user", "content": "x"}]}


async def _roundtrip(store: Any) -> None:
    alice, bob = owner_of("sk-alice"), owner_of("sk-bob")
    await store.put(alice, "resp_1", RECORD)
    assert await store.get(alice, "resp_1") == RECORD
    assert await store.get(bob, "resp_1") is None and not await store.delete(bob, "resp_1")
    assert await store.delete(alice, "resp_1") and await store.get(alice, "resp_1") is None
    await store.put(alice, "resp_2", RECORD)
    deadline = time.monotonic() + 10
    while await store.get(alice, "resp_2") is not None:
        assert time.monotonic() < deadline, "the record did not expire"
        await asyncio.sleep(0.05)
    await store.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_put_get_delete_owner_and_expiry(kind: str, redis_server: Any) -> None:
    store = make_store(redis_server.url if kind == "redis" else "memory", ttl_s=0.3)
    assert isinstance(store, RedisResponseStore if kind == "redis" else MemoryResponseStore)
    asyncio.run(_roundtrip(store))


def test_memory_store_keeps_its_newest_records() -> None:
    async def run() -> None:
        store = MemoryResponseStore(ttl_s=60, max_entries=3)
        for i in range(5):
            await store.put("o", f"r{i}", RECORD)
        assert [await store.get("o", f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    asyncio.run(run())


def test_redis_outage_is_503_not_404(own_redis: Any) -> None:
    async def run() -> None:
        store = RedisResponseStore(own_redis.url, ttl_s=60, timeout_s=0.5)
        await store.put("o", "r", RECORD)
        own_redis.kill()
        with pytest.raises(StoreUnavailable):
            await store.get("o", "r")
        answer = await ResponsesService(store).retrieve("o", "r")
        assert answer.status_code == 503 and b"response_store_unavailable" in bytes(answer.body)
        await store.close()
    asyncio.run(run())


def test_bad_store_url_and_ttl() -> None:
    with pytest.raises(ValueError):
        make_store("http://nope")
    with pytest.raises(ValueError):
        MemoryResponseStore(ttl_s=0)
