"""Anthropic's Messages API through the gateway: ``POST /v1/messages`` is translated onto a chat
completion (:mod:`pagedserve.apis.anthropic_translate`) and served like any chat request — key,
tier, buckets, pools, seats, shedding — then its answer (body or stream) translated back; every
refusal the gateway or the replica makes (401, 400, 429 with ``retry-after``, 503) answers in
Anthropic's error shape. ``POST /v1/messages/count_tokens`` is passed to a replica as it is.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedserve.apis import anthropic_translate as t
from pagedserve.apis.anthropic_protocol import MessagesRequest
from pagedserve.apis.anthropic_stream import AnthropicStream
from pagedserve.apis.relay import kept_headers, translated
from pagedserve.apis.validation import first_problem
from pagedserve.gateway.keys import presented_key

CHAT = "/v1/chat/completions"


def _reshaped(resp: Response) -> Response:
    """An error answer (the gateway's or a replica's, OpenAI-shaped) in Anthropic's shape."""
    if resp.status_code < 400:
        return resp
    try:
        body = json.loads(bytes(resp.body))
    except (ValueError, AttributeError):
        body = None
    return JSONResponse(t.from_openai_error(resp.status_code, body), resp.status_code, headers=kept_headers(resp))


def _invalid(exc: ValidationError) -> JSONResponse:
    return JSONResponse(t.error_body(400, first_problem(exc)[1]), 400)


def install_anthropic_routes(app: FastAPI, handle: Callable[..., Awaitable[Response]],
                             passthrough: Callable[..., Awaitable[Response]]) -> None:
    """Register the Messages API on the gateway ``app``: ``handle(gw, request, path, body)`` serves a
    chat body, ``passthrough(gw, request, path)`` relays a request that generates nothing."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        gw = request.app.state.gateway
        if gw.keys.lookup(presented_key(request.headers)) is None:  # refused before the body is read
            return JSONResponse(t.error_body(401, "Incorrect or missing API key: send 'x-api-key: <key>' (or "
                                                  "'Authorization: Bearer <key>') with a key this gateway knows."),
                                401)
        try:
            body = MessagesRequest.model_validate_json(await request.body())
            chat: dict[str, Any] = t.chat_body(body)
        except ValidationError as exc:
            return _invalid(exc)
        except t.TranslationError as exc:
            return JSONResponse(t.error_body(400, f"{exc.message} (field: {exc.param})"), 400)
        answer = await handle(gw, request, CHAT, chat)
        if answer.status_code >= 400:
            return _reshaped(answer)
        stops = list(body.stop_sequences or [])
        return await translated(answer, lambda c: t.message(c, stops), lambda: AnthropicStream(body.model, stops),
                                t.from_openai_error)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return _reshaped(await passthrough(request.app.state.gateway, request, "/v1/messages/count_tokens"))
