"""A streamed HTTP response that always runs its cleanup, however the response ends.

A client that leaves before the first chunk ends the response before its body generator starts,
and a generator that never started never runs its ``finally``. Both the engine server (abort the
engine request, free its KV blocks) and the gateway (give back the seat and the reservation) need
their cleanup to run in that case too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse


class ClosingStreamingResponse(StreamingResponse):
    """A :class:`StreamingResponse` that awaits ``on_close`` once it ends (shielded from cancellation)."""

    def __init__(self, content: AsyncIterator[Any], on_close: Callable[[], Awaitable[None]], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def on_close(self) -> None:
        """The cleanup, for a response that wraps this one's body (see pagedserve.apis.relay)."""
        await self._on_close()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
