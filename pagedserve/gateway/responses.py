"""OpenAI error bodies and the rate-limit headers the gateway adds (refusals and successes alike)."""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

from pagedserve.gateway.admission import Decision, format_duration

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 502: "server_error", 503: "server_overloaded", 504: "server_error"}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body, as the engine server answers it."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None, error_type: str | None = None) -> JSONResponse:
    """A JSON error response with OpenAI's body."""
    return JSONResponse(error_body(message, error_type or _TYPES.get(status, "invalid_request_error"), param, code),
                        status_code=status, headers=headers)


def retry_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up, at least 1) and the precise ``retry-after-ms``."""
    if math.isinf(seconds):
        return {}
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{tokens,requests}`` from the buckets' state."""
    headers: dict[str, str] = {}
    for kind, view in (("tokens", decision.token_view), ("requests", decision.request_view)):
        if view is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(int(view.limit))
        headers[f"x-ratelimit-remaining-{kind}"] = str(int(math.floor(view.remaining)))
        headers[f"x-ratelimit-reset-{kind}"] = format_duration(view.reset_s) if view.reset_s > 0 else "0s"
    return headers
