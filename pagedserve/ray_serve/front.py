"""``OpenAIFront``: the HTTP ingress of the Ray Serve application.

Ray's HTTP proxy hands a request to a replica before its body is read, so a router between the
proxy and the engine replicas could not see the prompt. The front reads the body (bounded: 413
past ``max_body_bytes``), computes the gateway's prefix key (:func:`pagedserve.gateway.pools.prefix_key`)
and the request's priority, and forwards the request through a handle whose router
(:mod:`~pagedserve.ray_serve.router`) uses them; the replica's answer is relayed message by message,
a stream's events as they come. Everything else is the replica's app: validation, errors, the
OpenAI bodies.

Failures are answered the project's way (OpenAI's error body):

- too many requests waiting for a replica (``max_queued_requests``): 503 ``queue_full`` + Retry-After;
- the replica died before answering: sent again to another (``retries`` times), then 503
  ``engine_unavailable``;
- the replica died mid-stream: an error event, then ``data: [DONE]`` (what the server itself sends
  when a request fails after its stream began); a plain body is cut off;
- no replica at all: 503 ``engine_unavailable``.
"""

from __future__ import annotations

import json
import logging
import sys
import weakref
from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedserve.gateway.pools import prefix_key
from pagedserve.ray_serve.router import RoutingTicket
from pagedserve.server.errors import error_body, error_response

logger = logging.getLogger("pagedserve.ray_serve")

# The parts of an ASGI scope an app reads; Ray's own additions stay on this side.
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string",
               "headers", "client", "server")
# A replica process gone or unreachable: nothing was done there that a retry could repeat.
_REPLICA_GONE = (ray_errors.ActorDiedError, ray_errors.ActorUnavailableError, ray_errors.RayActorError)
_MAX_PRIORITY = 2**31 - 1


def routing_for(method: str, body: bytes) -> dict[str, Any]:
    """The router's hints for a request: the prompt's prefix key and its priority (none for a body
    that is not a JSON object; the replica's app answers that one)."""
    if method != "POST" or not body:
        return {}
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(parsed, dict):
        return {}
    salt = parsed.get("cache_salt")
    key = prefix_key(parsed, salt if isinstance(salt, str) else "")
    priority = parsed.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > _MAX_PRIORITY:
        priority = 0
    return {"prefix_key": key, "priority": priority}


class OpenAIFront:
    """``async __call__(request)``: read, score, forward, relay (module docstring)."""

    def __init__(self, engine: DeploymentHandle, max_body_bytes: int = 4 * 1024 * 1024, retries: int = 1):
        self.engine = engine.options(method_name="forward", stream=True)
        self.max_body_bytes = max_body_bytes
        self.retries = retries

    async def __call__(self, request: Request) -> Response:
        body = await self._read_body(request)
        if body is None:
            return error_response(413, f"The request body is larger than this server's limit of "
                                       f"{self.max_body_bytes} bytes (--max-body-bytes); send a shorter prompt.",
                                  code="body_too_large")
        scope = {k: request.scope[k] for k in _SCOPE_KEYS if k in request.scope}
        scope["root_path"] = ""
        routing = routing_for(request.method, body)
        for attempt in range(self.retries + 1):
            ticket = RoutingTicket(routing.get("prefix_key"), routing.get("priority", 0))
            stream = self.engine.remote(scope, body, routing=ticket)
            try:
                start = await stream.__anext__()
            except BaseException:
                ticket.end()  # never answered: the replica holds nothing of it
                if attempt < self.retries and isinstance(sys.exc_info()[1], _REPLICA_GONE):
                    logger.warning("replica died before answering (attempt %d); sending it again", attempt + 1)
                    continue
                return _refusal(sys.exc_info()[1])
            return _relay(start, stream, ticket)
        raise AssertionError("unreachable: the last attempt returns")

    async def _read_body(self, request: Request) -> bytes | None:
        """The whole body, or None past ``max_body_bytes`` (read no further than that)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)


def _refusal(exc: BaseException | None) -> Response:
    """The answer to a request no replica answered (module docstring); anything else is raised."""
    if isinstance(exc, BackPressureError):
        return error_response(503, "Every replica is busy and the queue for them is full (--max-queued-requests); "
                                   "retry later.", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, (*_REPLICA_GONE, DeploymentUnavailableError, StopAsyncIteration)):
        return error_response(503, "No engine replica could take the request (they died or are restarting); "
                                   "retry later.", "server_error", code="engine_unavailable",
                              headers={"Retry-After": "1"})
    assert exc is not None
    raise exc


def _relay(start: dict[str, Any], stream: Any, ticket: RoutingTicket) -> Response:
    """A response that sends the replica's start message as it is, then its body messages; the
    ticket ends with the body, or when the body is dropped unread (the client left first)."""
    event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                       for k, v in start.get("headers", []))

    async def body() -> AsyncIterator[bytes]:
        try:
            async for message in stream:
                if message.get("type") == "http.response.body":
                    yield message.get("body", b"")
                    if not message.get("more_body", False):
                        return
        except _REPLICA_GONE:
            logger.warning("replica died mid-response")
            if event_stream:
                err = error_body("The engine replica serving this request died; retry it.", "server_error",
                                 None, "engine_unavailable")
                yield f"data: {json.dumps(err, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
        finally:
            stream.cancel()  # a no-op when it ended; otherwise the replica aborts the engine request
            ticket.end()

    chunks = body()
    weakref.finalize(chunks, ticket.end)
    response = StreamingResponse(chunks, status_code=start.get("status", 200))
    # The replica's headers exactly (content type, length, its replica id), not Starlette's defaults.
    response.raw_headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
    return response
