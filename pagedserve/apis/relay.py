"""Hand a chat completions answer back in another API's shape: one JSON body translated whole, a
stream of chat chunks translated event by event, an error body reshaped (status and headers kept).

The chat answer is a Starlette response, whoever made it: the server's own handler (in process) or
the gateway's relay of a replica's answer. A streamed one keeps its cleanup (abort the engine
request; give back the seat and settle the reservation) however the translated stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.streaming import ClosingStreamingResponse

# Headers of the chat answer that describe its body, not the request: the new body has its own.
_BODY_HEADERS = {"content-length", "content-type", "content-encoding", "transfer-encoding"}


class StreamTranslator(Protocol):
    """Chat SSE text in, the other API's SSE text out."""

    def feed(self, text: str) -> str: ...

    def end(self) -> str: ...


class ChatChunks:
    """Chat completion SSE text (in pieces of any size) → its decoded events: a chunk's dict, or
    the string ``[DONE]``. Lines that are not ``data:`` lines are skipped."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> list[Any]:
        self._pending += text
        cut = self._pending.rfind("\n")
        if cut < 0:
            return []
        lines, self._pending = self._pending[:cut].split("\n"), self._pending[cut + 1:]
        return [e for e in (self._event(line) for line in lines) if e is not None]

    def flush(self) -> list[Any]:
        rest, self._pending = self._pending, ""
        event = self._event(rest)
        return [event] if event is not None else []

    @staticmethod
    def _event(line: str) -> Any:
        line = line.removesuffix("\r")
        if not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            return data
        try:
            return json.loads(data)
        except ValueError:
            return None


def kept_headers(resp: Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _BODY_HEADERS}


def _body(resp: Response) -> Any:
    try:
        return json.loads(bytes(resp.body))
    except (ValueError, AttributeError):
        return None


async def translated(resp: Response, whole: Callable[[dict[str, Any]], dict[str, Any]],
                     stream: Callable[[], StreamTranslator],
                     error: Callable[[int, Any], dict[str, Any]],
                     on_final: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> Response:
    """``resp`` (a chat answer) in the other API's shape: ``whole`` turns a 200 body, ``stream()``
    makes the translator of a streamed one, ``error(status, body)`` reshapes an error body.
    ``on_final(obj)`` is awaited with a translator's ``final`` object as soon as it has one, before
    the events that announce it are sent (a client that reads them may follow up at once)."""
    headers = kept_headers(resp)
    if isinstance(resp, StreamingResponse):
        if resp.status_code != 200:  # the gateway streams nothing but 200s; defensive
            return JSONResponse(error(resp.status_code, None), resp.status_code, headers=headers)
        translator = stream()
        chunks: AsyncIterator[Any] = resp.body_iterator

        async def events() -> AsyncIterator[str]:
            kept = False
            async for piece in chunks:
                out = translator.feed(piece if isinstance(piece, str) else bytes(piece).decode("utf-8", "replace"))
                final = getattr(translator, "final", None)
                if on_final is not None and final is not None and not kept:
                    kept = True
                    await on_final(final)
                if out:
                    yield out
            tail = translator.end()
            if tail:
                yield tail

        async def close() -> None:
            await chunks.aclose()  # type: ignore[attr-defined]
            if isinstance(resp, ClosingStreamingResponse):
                await resp.on_close()

        return ClosingStreamingResponse(events(), close, status_code=200, headers=headers,
                                        media_type="text/event-stream")
    body = _body(resp)
    if resp.status_code == 200 and isinstance(body, dict):
        return JSONResponse(whole(body), 200, headers=headers)
    return JSONResponse(error(resp.status_code, body), resp.status_code, headers=headers)
