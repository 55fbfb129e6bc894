"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API) on the
server: each request is translated onto a chat completion run by the chat handler in process
(:mod:`pagedserve.apis.anthropic_translate`), and its answer translated back; every refusal, from
the schema's to the engine's, answers in Anthropic's error shape. See docs/ANTHROPIC.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from pagedserve import errors
from pagedserve.apis import anthropic_translate as t
from pagedserve.apis.anthropic_protocol import CountTokensRequest, ErrorResponse, MessagesRequest
from pagedserve.apis.anthropic_stream import AnthropicStream
from pagedserve.apis.relay import kept_headers, translated
from pagedserve.server import protocol as p
from pagedserve.server.errors import error_response, from_engine_error, validation_message
from pagedserve.server.serving import OpenAIServing

_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 429, 503)}


def anthropic_shaped(resp: Response) -> Response:
    """An OpenAI error response of the server in Anthropic's shape (status and headers kept)."""
    try:
        body = json.loads(bytes(resp.body))
    except ValueError:
        body = None
    return JSONResponse(t.from_openai_error(resp.status_code, body), resp.status_code, headers=kept_headers(resp))


def _validation(exc: ValidationError | RequestValidationError) -> JSONResponse:
    message, param, code = validation_message(list(exc.errors()))
    return error_response(400, message, "invalid_request_error", param=param, code=code)


class AnthropicRoute(APIRoute):
    """A route whose refusals (the schema's, the translation's, the engine's) are Anthropic errors."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def shaped(request: Request) -> Response:
            try:
                resp = await handler(request)
            except (RequestValidationError, ValidationError) as exc:
                resp = _validation(exc)
            except t.TranslationError as exc:
                resp = error_response(400, exc.message, "invalid_request_error", param=exc.param)
            except errors.PagedServeError as exc:
                resp = from_engine_error(exc)
            return anthropic_shaped(resp) if resp.status_code >= 400 else resp

        return shaped


def chat_request(body: dict[str, Any]) -> p.ChatCompletionRequest:
    """The translated body through the chat schema (its text checks and bounds apply too)."""
    return p.ChatCompletionRequest.model_validate_json(json.dumps(body))


def install_anthropic_routes(app: FastAPI, serving: Callable[[Request], OpenAIServing]) -> None:
    """Register the Messages API's routes on ``app``, served by ``serving(request)``'s chat handler."""
    router = APIRouter(route_class=AnthropicRoute, tags=["anthropic"])

    @router.post("/v1/messages", responses={200: {"description": "An Anthropic message, or its events"}, **_ERRORS})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API, run as a chat completion (docs/ANTHROPIC.md)."""
        chat = chat_request(t.chat_body(body))
        answer = await serving(request).chat(chat, request)
        stops = list(body.stop_sequences or [])
        return await translated(answer, lambda c: t.message(c, stops),
                                lambda: AnthropicStream(body.model, stops), t.from_openai_error)

    @router.post("/v1/messages/count_tokens", responses=_ERRORS)
    async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
        """The prompt's tokens as the model sees it (chat template, system prompt and tools included)."""
        chat_body = {"model": body.model, "messages": t.chat_messages(body), **t.chat_tools(body)}
        chat = chat_request(chat_body)
        api = serving(request).chat_api
        api.check_model(chat.model)
        api.tool_mode(chat)
        ids = await api.chat_prompt(chat.messages, True, None, chat.tools)
        return JSONResponse({"input_tokens": len(ids)})

    app.include_router(router)
