"""The HTTP server's own settings (the engine's live in :class:`pagedserve.config.EngineConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ServerConfig:
    """How the OpenAI-compatible server listens and what it accepts.

    ``random_weights`` marks the embedded default model, so ``/v1/models`` and the startup log can
    say that its output is noise and how to serve a real model. ``log_requests`` logs one line per
    finished request (off by default: at hundreds of requests a second it is work on the event loop).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the engine's model name
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout_s: float = 5.0
    random_weights: bool = False
    model_description: str | None = None
    log_requests: bool = False  # one INFO line per finished request: its id, priority, tokens and timings
    # HTTP limits (pagedserve.server.limits): what one connection may hold and for how long.
    request_timeout_s: float | None = None  # whole request, arrival to last byte; None = no limit
    read_timeout_s: float = 10.0  # the request head, then the body, each within this (else 408)
    keep_alive_timeout_s: float = 5.0  # an idle connection (no request in progress) is closed after this
    max_header_bytes: int = 32 * 1024  # request line + headers (else 431; a longer URL alone: 414)
    max_headers: int = 100  # header lines (else 431)
    chat_template: str | None = None  # a Jinja chat template replacing the tokenizer's (--chat-template)
    # Tool calling: how model output is read as tool calls for tool_choice "auto", which is enabled
    # by --enable-auto-tool-choice, or where the chat template shows a format this server reads
    # (server/tool_format.py). None: the template's format, else hermes.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # With --api-server-count N > 1: which of the N front processes this app runs in (0..N-1); it
    # answers every response with an x-pagedserve-api-server header. None: the only front.
    api_server_index: int | None = None
    # The Responses API's store (pagedserve.apis.response_store): "memory" or a redis:// URL, and
    # how long a stored response lives.
    response_store: str = "memory"
    response_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
        if self.request_timeout_s is not None and not (math.isfinite(self.request_timeout_s)
                                                       and self.request_timeout_s > 0):
            raise ValueError(f"request_timeout_s must be a positive number of seconds (or None: no limit), "
                             f"got {self.request_timeout_s}")
        for name in ("read_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        if self.max_headers < 8:
            raise ValueError(f"max_headers must be at least 8, got {self.max_headers}")
        from pagedserve.server.tool_parsers import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {self.tool_call_parser!r}")
        if not (self.response_store == "memory" or self.response_store.startswith(("redis://", "rediss://",
                                                                                      "unix://"))):
            raise ValueError(f"response_store must be 'memory' or a redis:// URL, got {self.response_store!r}")
        if not (math.isfinite(self.response_ttl_s) and self.response_ttl_s > 0):
            raise ValueError(f"response_ttl_s must be a positive number of seconds, got {self.response_ttl_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to disable authentication)")
