"""Where stored responses live, for ``previous_response_id``: in this process's memory, or in Redis
so that every gateway process (or API server) in front of the replicas reads the same ones.

A record is the response object and the conversation that led to it (every input item of the
chain, expanded), so a follow-up costs one read, and the replicas stay stateless. Records expire
after the TTL and are kept under their owner — a digest of the API key that created them — so
one key never reads, continues or deletes another's: to it they do not exist (404).
"""

from __future__ import annotations

import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

KEY_PREFIX = "pagedserve:response:"
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_ENTRIES = 10_000  # the memory store's bound: the oldest go first


class StoreUnavailable(RuntimeError):
    """The store could not be read or written (Redis down or too slow): a 503, never a wrong 404."""


def owner_of(api_key: str | None) -> str:
    """The owner a key's responses are kept under (its SHA-256, as the gateway stores keys)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()


class ResponseStore(ABC):
    """``put`` / ``get`` / ``delete`` a record by (owner, response id)."""

    def __init__(self, ttl_s: float):
        if not ttl_s > 0:
            raise ValueError(f"the response TTL must be a positive number of seconds, got {ttl_s}")
        self.ttl_s = ttl_s

    @abstractmethod
    async def put(self, owner: str, response_id: str, record: dict[str, Any]) -> None: ...

    @abstractmethod
    async def get(self, owner: str, response_id: str) -> dict[str, Any] | None: ...

    @abstractmethod
    async def delete(self, owner: str, response_id: str) -> bool: ...

    async def close(self) -> None:
        return None


class MemoryResponseStore(ResponseStore):
    """One process's records, the oldest dropped past ``max_entries``."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES):
        super().__init__(ttl_s)
        self.max_entries = max_entries
        self._records: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()

    async def put(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        self._records[(owner, response_id)] = (time.monotonic() + self.ttl_s, json.dumps(record))
        while len(self._records) > self.max_entries:
            self._records.popitem(last=False)

    async def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        entry = self._records.get((owner, response_id))
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._records[(owner, response_id)]
            return None
        return json.loads(entry[1])

    async def delete(self, owner: str, response_id: str) -> bool:
        found = await self.get(owner, response_id) is not None
        self._records.pop((owner, response_id), None)
        return found


class RedisResponseStore(ResponseStore):
    """Records in Redis (``SET … PX ttl``): shared by every process that is given the same URL."""

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 2.0):
        super().__init__(ttl_s)
        import redis.asyncio as redis

        self.url = url
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    @staticmethod
    def _key(owner: str, response_id: str) -> str:
        return f"{KEY_PREFIX}{owner}:{response_id}"

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import redis

        try:
            return await getattr(self._redis, method)(*args, **kwargs)
        except (redis.RedisError, OSError) as e:
            raise StoreUnavailable(f"the response store (Redis) failed: {type(e).__name__}") from e

    async def put(self, owner: str, response_id: str, record: dict[str, Any]) -> None:
        await self._call("set", self._key(owner, response_id), json.dumps(record), px=int(self.ttl_s * 1000))

    async def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        raw = await self._call("get", self._key(owner, response_id))
        return json.loads(raw) if raw is not None else None

    async def delete(self, owner: str, response_id: str) -> bool:
        return bool(await self._call("delete", self._key(owner, response_id)))

    async def close(self) -> None:
        await self._redis.aclose()


def make_store(url: str | None, ttl_s: float = DEFAULT_TTL_S) -> ResponseStore:
    """``redis://…`` (or ``rediss://``): Redis; None or ``memory``: this process's memory."""
    if url is None or url == "memory":
        return MemoryResponseStore(ttl_s)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisResponseStore(url, ttl_s)
    raise ValueError(f"response store must be 'memory' or a redis:// URL, got {url!r}")
