"""Several engine requests answered as one response: the prompts of one completions request.

OpenAI numbers the choices of a request with several prompts ``i * n + j`` (prompt ``i``, its
``j``-th completion). The engine knows nothing of that: each prompt is its own engine request
with its own id, and :class:`RequestGroup` merges their output streams, rewriting each
completion's index to its place in the response, so the handlers that format one request's
outputs format a group's unchanged. Aborting the group aborts every member, whichever way the
response ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from pagedserve.engine import RequestStream
from pagedserve.engine.outputs import RequestOutput

_DONE = object()  # a member's stream ended


class RequestGroup:
    """Async iterator over the re-indexed outputs of ``len(streams)`` engine requests.

    ``stride`` is how many completions each engine request has (``n``, or ``best_of``): member
    ``i``'s completion ``j`` comes out with index ``i * stride + j``.
    """

    def __init__(self, streams: list[RequestStream], stride: int):
        self.streams = streams
        self.stride = stride
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(streams)

    @classmethod
    async def add(cls, submit: Callable[[str, int], Awaitable[RequestStream]], request_id: str,
                  num_prompts: int, stride: int) -> RequestGroup:
        """Submit ``num_prompts`` engine requests with ``submit(engine_request_id, i)``, all at once (each
        waits for the step loop to admit it: one after the other, 64 prompts would wait 64 steps); if
        one is refused or the caller is cancelled, those admitted are aborted and the error raised."""
        if num_prompts == 1:
            return cls([await submit(request_id, 0)], stride)
        tasks = [asyncio.ensure_future(submit(f"{request_id}-{i}", i)) for i in range(num_prompts)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                if not t.done():
                    t.cancel()  # a submission cancelled mid-admission takes itself back out
                elif not t.cancelled() and t.exception() is None:
                    t.result().abort()
            raise
        return cls([t.result() for t in tasks], stride)

    def abort(self) -> None:
        """Abort every member still running (idempotent)."""
        for task in self._tasks:
            task.cancel()
        for s in self.streams:
            s.abort()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        if len(self.streams) == 1:  # the common case: no tasks, no copies
            async for out in self.streams[0]:
                yield out
            return
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            while self._open:
                i, item = await self._queue.get()
                if item is _DONE:
                    self._open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, RequestOutput)
                    offset = i * self.stride
                    yield dataclasses.replace(item, outputs=[dataclasses.replace(c, index=offset + c.index)
                                                             for c in item.outputs])
        finally:
            self.abort()

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((i, out))
        except Exception as exc:  # the member's failure ends the whole response
            self._queue.put_nowait((i, exc))
        finally:
            self._queue.put_nowait((i, _DONE))
