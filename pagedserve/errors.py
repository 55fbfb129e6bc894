"""Typed errors raised by the engine, turned into HTTP bodies in one place (the server).

Each error carries the OpenAI error ``type``/``code``/``param`` the server should answer with, so
the engine never needs to know about HTTP and the server never guesses from message text.
"""

from __future__ import annotations


class PagedServeError(Exception):
    """Base class: a request the engine refuses, with an OpenAI-style classification."""

    status_code: int = 400
    error_type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(PagedServeError, ValueError):
    """A request whose fields make no sense (bad sampling values, empty prompt, ...)."""

    code = "invalid_value"


class RequestTooLong(InvalidRequest):
    """A request that can never fit: longer than max_model_len or than the whole KV pool."""

    code = "context_length_exceeded"


class QueueFull(PagedServeError):
    """The waiting queue is at ``max_waiting``: retry later (the server answers 503 + Retry-After)."""

    status_code = 503
    error_type = "server_overloaded"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DuplicateRequestId(InvalidRequest):
    """``add_request`` was given an id that is still live."""

    code = "duplicate_request_id"


def startup_error_line(exc: BaseException) -> str:
    """One line for a failure to build the engine, for ``serve`` and ``generate`` alike.

    A bad path, flag or budget (``OSError``, ``ValueError``: the loader's and the config's own
    errors, whose messages name the fix) is shown as its message alone; anything else also names
    its type, since that is what a bug report needs.
    """
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, (ValueError, OSError)) and message:
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
