"""Every error the server answers, turned into OpenAI's body in one place.

``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for anything the client can
fix, 503 + ``Retry-After`` when the queue is full, and a 500 only for our own bugs.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve import errors

logger = logging.getLogger(__name__)

_HTTP_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "server_overloaded",
    504: "server_error",
}


class APIError(errors.PagedServeError):
    """An HTTP-level refusal raised by the server itself (auth, unknown model, body size, ...)."""

    def __init__(self, status_code: int, message: str, *, error_type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message, param=param)
        self.status_code = status_code
        self.error_type = error_type or _HTTP_TYPES.get(status_code, "invalid_request_error")
        self.code = code
        self.headers = headers or {}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status_code: int, message: str, error_type: str | None = None, *,
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse carrying OpenAI's error body."""
    return JSONResponse(
        error_body(message, error_type or _HTTP_TYPES.get(status_code, "invalid_request_error"), param, code),
        status_code=status_code, headers=headers,
    )


def from_engine_error(exc: errors.PagedServeError) -> JSONResponse:
    """Map a typed engine error (or :class:`APIError`) to its HTTP answer."""
    headers = dict(getattr(exc, "headers", {}) or {})
    if isinstance(exc, errors.QueueFull):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    elif exc.status_code == 503:
        headers.setdefault("Retry-After", "1")
    return error_response(exc.status_code, exc.message, exc.error_type, param=exc.param,
                          code=exc.code, headers=headers or None)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """``('body', 'messages', 0, 'content', 'str')`` → ``messages[0].content``.

    Pydantic adds the union member it tried (``str``, ``list[int]``, ``function-after[...]``) to
    the location; those are not fields the client sent, so they are dropped.
    """
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif any(c in item for c in "[]()-") or item in {"str", "int", "float", "bool", "none", "list", "dict"}:
            continue
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _is_type_mismatch(e: dict[str, Any]) -> bool:
    kind = str(e.get("type", ""))
    return kind.endswith("_type") or kind == "none_required"


def validation_message(errs: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    """Summarise pydantic errors as (message, param, code) telling the client what to fix."""
    if any(e.get("type") == "json_invalid" for e in errs):
        e = next(e for e in errs if e.get("type") == "json_invalid")
        detail = (e.get("ctx") or {}).get("error", "invalid JSON")
        pos = e["loc"][-1] if e.get("loc") and isinstance(e["loc"][-1], int) else None
        where = f" at character {pos}" if pos is not None else ""
        return f"The request body is not valid JSON ({detail}{where}); send a JSON object.", None, "invalid_json"
    seen: dict[str | None, str] = {}
    mismatch_only: set[str | None] = set()
    for e in errs:
        param = _param_from_loc(tuple(e.get("loc", ())))
        if e.get("type") == "extra_forbidden":
            text = "is not a supported field; remove it (see GET /docs for the accepted fields)"
        elif e.get("type") == "missing":
            text = "is required"
        else:
            text = e.get("msg", "is invalid")
            text = text.removeprefix("Value error, ")
            text = text[0].lower() + text[1:] if text else text
        # First complaint per field (union members repeat themselves), except that one about the
        # value (a bound) says more than "should be a valid string" from a member whose type did
        # not match, whichever member pydantic tried first.
        if param not in seen or (param in mismatch_only and not _is_type_mismatch(e)):
            seen[param] = text
            if _is_type_mismatch(e):
                mismatch_only.add(param)
            else:
                mismatch_only.discard(param)
    # A type mismatch of a field whose element has its own complaint ('stop' is not a string, and
    # 'stop[0]' is too long) is the union talking: the element's complaint is the one to fix.
    items = [(p, t) for p, t in seen.items()
             if not (p in mismatch_only and p is not None
                     and any(q is not None and q.startswith((p + "[", p + ".")) for q in seen))]
    summary = "; ".join(f"'{p}' {t}" if p else t for p, t in items[:3])
    if len(items) > 3:
        summary += f" (and {len(items) - 3} more)"
    code = "unknown_field" if errs and errs[0].get("type") == "extra_forbidden" else "invalid_value"
    if items and items[0][0] is None:  # the body itself, not a field, is wrong
        return "The request body must be a JSON object (Content-Type: application/json).", None, "invalid_body"
    return f"Invalid request: {summary}.", items[0][0] if items else None, code


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that make every error an OpenAI error body."""

    @app.exception_handler(errors.PagedServeError)
    async def _engine_error(_: Request, exc: errors.PagedServeError) -> JSONResponse:
        return from_engine_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = validation_message(list(exc.errors()))
        return error_response(400, message, "invalid_request_error", param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = "Not found: see GET /docs for the endpoints this server offers."
        elif exc.status_code == 405:
            message = f"Method not allowed on this path ({exc.detail}); see GET /docs."
        elif exc.status_code == 400 and "parsing the body" in message:
            message = "The request body could not be parsed; send a UTF-8 JSON object with Content-Type: application/json."
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return error_response(500, f"Internal server error: {type(exc).__name__}. This is a bug in pagedserve.",
                              "server_error", code="internal_error")
