"""The load generators' HTTP client: one streamed POST, read as server-sent-event data lines.

Built on aiohttp, as vLLM's ``bench serve`` is: its HTTP parser is C, where httpx's (h11) is
Python. The load generators run on the same cores as the servers they measure, so what they
spend per streamed event is taken from the server: W6's free-tier client reading every admitted
stream through httpx used 0.22-0.39 cores of a 2-core machine (docs/BENCHMARKS.md, W6).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

# What a request can fail with on the client's side: connection errors and timeouts.
CLIENT_ERRORS = (aiohttp.ClientError, TimeoutError)


def session(base_url: str, timeout_s: float, headers: Mapping[str, str] | None = None) -> aiohttp.ClientSession:
    """A session for one load generator: no cap on open connections (every arrival is sent when
    it is due, as an open-loop load must be), ``timeout_s`` for a whole request."""
    return aiohttp.ClientSession(base_url, headers=dict(headers or {}),
                                 connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


@dataclass
class StreamedResponse:
    """A response being read: its status and headers, and (on 200) its SSE data lines."""

    status: int
    headers: Mapping[str, str]
    _response: aiohttp.ClientResponse

    async def body(self) -> bytes:
        """The whole body (an error's)."""
        return await self._response.read()

    async def data_lines(self) -> AsyncIterator[str]:
        """Each ``data:`` line's payload, as it arrives (``[DONE]`` included)."""
        async for raw in self._response.content:
            if raw.startswith(b"data:"):
                yield raw[5:].strip().decode()


@asynccontextmanager
async def stream_post(http: aiohttp.ClientSession, path: str, body: dict[str, Any],
                      headers: Mapping[str, str] | None = None) -> AsyncIterator[StreamedResponse]:
    """POST ``body`` as JSON to ``path`` and hold the response open while the caller reads it."""
    async with http.post(path, json=body, headers=headers) as r:
        yield StreamedResponse(r.status, r.headers, r)
