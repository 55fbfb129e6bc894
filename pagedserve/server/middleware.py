"""ASGI middleware that runs before any body is parsed: API key, body size, UTF-8.

It is plain ASGI (not a FastAPI dependency) so an unauthenticated or oversized request is refused
without reading or parsing its body.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starlette.responses import JSONResponse

from pagedserve.apis.anthropic_translate import error_body as anthropic_error_body
from pagedserve.server.errors import error_response

# Paths that need the API key when one is set; /health, /metrics and /load stay open for probes.
# The dashboard's page and scripts are open (they hold no data); its feed of requests is not.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/dashboard/events")


API_SERVER_HEADER = "x-pagedserve-api-server"
# Anthropic's API: its clients send the key as x-api-key and read errors in Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"


def _presented_key(headers: dict[str, str]) -> str | None:
    """The key of ``Authorization: Bearer KEY``, else of ``x-api-key`` (Anthropic's clients send that)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def _refusal(path: str, status: int, message: str, error_type: str, *, code: str,
             headers: dict[str, str] | None = None) -> JSONResponse:
    """The guard's refusal in the shape of the API the path belongs to."""
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_error_body(status, message), status, headers=headers)
    return error_response(status, message, error_type, code=code, headers=headers)


class ResponseHeaderMiddleware:
    """Add one fixed header to every HTTP response: which front process answered
    (``serve --api-server-count N``, :data:`API_SERVER_HEADER`) or which Ray replica did, so a
    client, a test or a log can tell them apart."""

    def __init__(self, app: ASGIApp, name: str, value: str):
        self.app = app
        self._header = (name.encode(), value.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class GuardMiddleware:
    """Check ``Authorization: Bearer``, cap the body at ``max_body_bytes`` and require UTF-8."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path: str = scope.get("path", "")
        if self.api_key is not None and path.startswith(PROTECTED_PREFIXES):
            presented = _presented_key(headers)
            if presented is None or not hmac.compare_digest(presented.encode(), self.api_key.encode()):
                what = "invalid" if headers.get("authorization") or headers.get("x-api-key") else "missing"
                await _refusal(path, 401, f"API key {what}: send 'Authorization: Bearer <key>' (or 'x-api-key: "
                                          "<key>') with this server's --api-key.", "authentication_error",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        # Read the whole body (at most the limit) so size and encoding are checked before parsing.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await _refusal(path, 400, f"The request body is not valid UTF-8 (byte 0x{body[exc.start]:02x} at "
                                      f"offset {exc.start}); encode the JSON as UTF-8.",
                                 "invalid_request_error", code="invalid_encoding")(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response: Any = _refusal(
            scope.get("path", ""), 413, f"The request body is larger than this server's limit of "
            f"{self.max_body_bytes} bytes (--max-body-bytes); send a shorter prompt.", "invalid_request_error",
            code="body_too_large")
        await response(scope, receive, send)
