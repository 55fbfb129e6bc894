"""HTTP limits of the engine server: how big a request head may be, how long a connection may be
held, and how long a request may run.

Two layers, each doing what only it can:

- **The HTTP protocol** (:class:`LimitedHttpToolsProtocol`, uvicorn's httptools protocol with
  limits; :func:`uvicorn_limits` gives the ``uvicorn.Config`` arguments). Uvicorn's httptools
  protocol has no header-size or header-count limit (``h11_max_incomplete_event_size`` is only
  read by the h11 protocol), no timeout on a request head or body that never finishes, and arms
  its keep-alive timer only after a first response. So here, before any ASGI app runs:

  * a request line plus headers over ``max_header_bytes``, or more than ``max_headers`` header
    lines, is answered 431 (a URL alone over the limit: 414) and the connection closed;
  * a request head not complete ``read_timeout_s`` after its first byte, or a body not complete
    ``read_timeout_s`` after its head (a short body sent with a long ``Content-Length``), is
    answered 408 and the connection closed; the app sees the client as gone;
  * a connection with no request in progress is closed after ``keep_alive_timeout_s``
    (uvicorn's ``timeout_keep_alive``), also before its first request.

- **ASGI** (:class:`LimitsMiddleware`, which the protocol puts around the app it serves, so
  ``uvicorn_limits`` is the one thing to plug in):

  * ``request_timeout_s`` (off by default): a request still running after it is cancelled (its
    engine request aborted, its KV blocks freed). One that had not answered yet gets 504 with
    OpenAI's error body; a stream gets an error event, then ``data: [DONE]``.
  * HTTP/1.0 has no chunked transfer encoding, but uvicorn's httptools protocol chunks any
    response without a ``Content-Length``, whatever the client's version. For an HTTP/1.0
    client a streamed answer is therefore collected and sent whole, with ``Content-Length``
    (uvicorn then closes the connection, as HTTP/1.0 expects). The events arrive together at
    the end instead of one by one: HTTP/1.0 cannot do better through this protocol.

Every refusal has OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedserve.server.errors import _HTTP_TYPES, error_body

if TYPE_CHECKING:
    from pagedserve.server.config import ServerConfig

logger = logging.getLogger(__name__)

# An HTTP/1.0 streamed answer is held in memory until it ends; past this it is cut off (the
# connection closes without a complete response) rather than held without bound.
HTTP10_BUFFER_LIMIT = 64 * 1024 * 1024


def uvicorn_limits(config: ServerConfig) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that apply ``config``'s HTTP limits.

    ``uvicorn.Config(app, host=..., port=..., **uvicorn_limits(server_config))``.
    """
    protocol = type("PagedServeHttpProtocol", (LimitedHttpToolsProtocol,), {
        "max_header_bytes": config.max_header_bytes,
        "max_headers": config.max_headers,
        "read_timeout_s": config.read_timeout_s,
        "request_timeout_s": config.request_timeout_s,
        "_wrapped_app": None,
    })
    return {"http": protocol, "timeout_keep_alive": config.keep_alive_timeout_s}


def _raw_error(status: int, message: str, code: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 error response (OpenAI's body), closing the connection."""
    body = json.dumps(error_body(message, _HTTP_TYPES.get(status, "invalid_request_error"), None, code)).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
    lines += [name + b": " + value + b"\r\n" for name, value in default_headers]
    lines += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
              b"connection: close\r\n", b"\r\n", body]
    return b"".join(lines)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol with head-size, header-count, head/body-read and idle limits.

    :func:`uvicorn_limits` makes a subclass with the configured values. Uvicorn's own parsing,
    pipelining, flow control and keep-alive handling are unchanged: the limits wrap its parser
    callbacks. Once a request is refused the connection is done: every later callback and
    received byte is ignored while it closes.
    """

    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    read_timeout_s: float = 10.0
    request_timeout_s: float | None = None
    _wrapped_app: tuple[Any, LimitsMiddleware] | None = None  # (uvicorn's app, it in LimitsMiddleware)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One protocol object per connection; one LimitsMiddleware around the app for them all.
        cls = type(self)
        if cls._wrapped_app is None or cls._wrapped_app[0] is not self.app:
            cls._wrapped_app = (self.app, LimitsMiddleware(self.app, self.request_timeout_s))
        self.app = cls._wrapped_app[1]
        self._refused = False
        self._in_head = False
        self._head_bytes = 0  # exact: request line and complete header lines so far
        self._head_raw = 0  # coarse: bytes received while the head is incomplete (catches one huge line)
        self._head_count = 0
        self._read_timer: asyncio.TimerHandle | None = None

    # ---- connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Uvicorn arms its keep-alive timer after a response only: a connection that never sends
        # a request would otherwise be held for ever. Its first byte cancels the timer.
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._in_head and not self._refused:
            self._head_raw += len(data)
            if self._head_raw > self.max_header_bytes:
                self._refuse(431, f"The request's headers are larger than this server's limit of "
                                  f"{self.max_header_bytes} bytes (--max-header-bytes); send fewer or shorter "
                                  "headers.", "headers_too_large")

    # ---- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refused:
            return
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = self._head_raw = self._head_count = 0
        self._arm_read_timer(self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        if self._refused:
            return
        self._head_bytes += len(url)
        if self._head_bytes > self.max_header_bytes:
            self._refuse(414, f"The request URL is longer than this server's limit of {self.max_header_bytes} "
                              "bytes (--max-header-bytes).", "url_too_long")
            return
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._head_count += 1
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_count > self.max_headers:
            self._refuse(431, f"The request has more than this server's limit of {self.max_headers} header lines "
                              "(--max-headers); send fewer headers.", "too_many_headers")
            return
        if self._head_bytes > self.max_header_bytes:
            self._refuse(431, f"The request's headers are larger than this server's limit of "
                              f"{self.max_header_bytes} bytes (--max-header-bytes); send fewer or shorter headers.",
                         "headers_too_large")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._cancel_read_timer()
        super().on_headers_complete()
        # Until on_message_complete: the body has read_timeout_s to arrive (none: cancelled at once).
        self._arm_read_timer(self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._cancel_read_timer()
        super().on_message_complete()

    # ---- timers and refusals -----------------------------------------------------------------

    def _arm_read_timer(self, callback: Any) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, callback)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _busy(self) -> bool:
        """An earlier request on this connection is still being answered (this head is pipelined)."""
        cycle = self.cycle
        return (cycle is not None and not cycle.response_complete) or bool(self.pipeline)

    def _head_timed_out(self) -> None:
        self._read_timer = None
        if self._refused or not self._in_head or self.transport.is_closing():
            return
        if self._busy():
            # The connection is busy answering an earlier request: the clock restarts.
            self._arm_read_timer(self._head_timed_out)
            return
        self._refuse(408, f"The request's headers did not arrive within this server's read timeout of "
                          f"{self.read_timeout_s:g} s (--read-timeout).", "header_read_timeout")

    def _body_timed_out(self) -> None:
        self._read_timer = None
        cycle = self.cycle
        if self._refused or cycle is None or not cycle.more_body or cycle.disconnected \
                or self.transport.is_closing():
            return
        if any(queued is cycle for queued, _ in self.pipeline) or (cycle.response_started
                                                                   and not cycle.response_complete):
            # Queued behind an earlier request (reading is paused, its body cannot arrive yet), or
            # answered early and the answer is still being sent: look again later.
            self._arm_read_timer(self._body_timed_out)
            return
        self._refuse(408, f"The request body did not arrive within this server's read timeout of "
                          f"{self.read_timeout_s:g} s (--read-timeout): fewer bytes came than Content-Length "
                          "announced, or they came too slowly.", "body_read_timeout", own_cycle=True)

    def _refuse(self, status: int, message: str, code: str, own_cycle: bool = False) -> None:
        """Answer ``status`` and close the connection; only close it where an answer cannot be
        written (an earlier request's answer is still due, or this one's was already sent).

        ``own_cycle``: ``self.cycle`` is the refused request's (its body timed out); otherwise the
        refused request never got past its head and any cycle is an earlier request's.
        """
        self._refused = True
        self._in_head = False
        self._cancel_read_timer()
        logger.warning("refusing a request from %s with %d: %s", self.client, status, code)
        cycle = self.cycle
        writable = (cycle is not None and not cycle.response_started) if own_cycle else not self._busy()
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app still running for it sees the client as gone
            cycle.message_event.set()
        if self.transport.is_closing():
            return
        if writable:
            self.transport.write(_raw_error(status, message, code, self.server_state.default_headers))
        self.transport.close()


class LimitsMiddleware:
    """Per-request timeout, and HTTP/1.0 answers without chunked encoding (see the module doc)."""

    def __init__(self, app: ASGIApp, request_timeout_s: float | None = None):
        self.app = app
        self.request_timeout_s = request_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        http10 = scope.get("http_version") == "1.0" and scope.get("method") != "HEAD"
        if self.request_timeout_s is None and not http10:
            await self.app(scope, receive, send)
            return
        response = _Response(send, buffer=http10)
        if self.request_timeout_s is None:
            await self.app(scope, receive, response.send)
            return
        with anyio.move_on_after(self.request_timeout_s) as timer:
            await self.app(scope, receive, response.send)
        if timer.cancelled_caught and not response.complete:
            await response.timed_out(self.request_timeout_s)


class _Response:
    """Tracks what of a response has been sent; for HTTP/1.0 holds a body without a length until
    it is complete and sends it with one."""

    def __init__(self, send: Send, buffer: bool):
        self._send = send
        self._buffer = buffer
        self._held_start: Message | None = None
        self._held: list[bytes] = []
        self._held_bytes = 0
        self.started = False
        self.complete = False
        self.event_stream = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = message.get("headers", [])
            self.event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in headers)
            if self._buffer and not any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers):
                self._held_start = message
                return
        elif message["type"] == "http.response.body":
            if not message.get("more_body", False):
                self.complete = True
            if self._held_start is not None:
                chunk = message.get("body", b"")
                self._held.append(chunk)
                self._held_bytes += len(chunk)
                if self._held_bytes > HTTP10_BUFFER_LIMIT:
                    raise RuntimeError(f"an HTTP/1.0 streamed answer passed {HTTP10_BUFFER_LIMIT} bytes; cut off")
                if self.complete:
                    await self._send_held()
                return
        await self._send(message)

    async def _send_held(self) -> None:
        start, body = self._held_start, b"".join(self._held)
        assert start is not None
        self._held_start, self._held = None, []
        headers = [*start.get("headers", []), (b"content-length", str(len(body)).encode())]
        await self._send({**start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def timed_out(self, timeout_s: float) -> None:
        """End a response cut off by the request timeout the way its client can understand."""
        message = (f"The request did not finish within this server's request timeout of {timeout_s:g} s "
                   "(--request-timeout) and was aborted; ask for fewer tokens or retry later.")
        body = error_body(message, "server_error", None, "request_timeout")
        if not self.started:
            data = json.dumps(body).encode()
            await self.send({"type": "http.response.start", "status": 504,
                             "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(data)).encode())]})
            await self.send({"type": "http.response.body", "body": data, "more_body": False})
        elif self.event_stream:
            tail = f"data: {json.dumps(body, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
            await self.send({"type": "http.response.body", "body": tail, "more_body": False})
        # Otherwise a non-stream body was cut in the middle: nothing can be appended to it, and
        # uvicorn closes the connection of a response the app left incomplete.
