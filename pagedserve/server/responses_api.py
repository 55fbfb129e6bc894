"""OpenAI's Responses API on the server: ``POST /v1/responses`` runs as a chat completion in process,
``GET`` / ``DELETE /v1/responses/{id}`` read the store (--response-store: memory, or Redis shared
with other servers and gateways). Responses are kept under the API key that made them. See
docs/RESPONSES.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Path, Request
from fastapi.responses import Response
from pydantic import ValidationError

from pagedserve.apis.response_store import make_store, owner_of
from pagedserve.apis.responses_protocol import MAX_RESPONSE_ID_CHARS, ResponsesRequest
from pagedserve.apis.responses_service import ResponsesService
from pagedserve.server import protocol as p
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import error_response, validation_message
from pagedserve.server.serving import OpenAIServing

ResponseIdPath = Annotated[str, Path(min_length=1, max_length=MAX_RESPONSE_ID_CHARS, pattern=r"^[A-Za-z0-9_-]+$")]
_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": p.ErrorResponse} for s in (400, 401, 404, 413, 503)}


def request_owner(request: Request) -> str:
    """The owner of what this request stores: its key (bearer or x-api-key; the guard checked it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key")
    return owner_of(key)


def install_responses_routes(app: FastAPI, serving: Callable[[Request], OpenAIServing], config: ServerConfig) -> None:
    """Register the Responses API on ``app``; its store is ``app.state.responses.store`` (closed by the
    app's lifespan)."""
    service = app.state.responses = ResponsesService(make_store(config.response_store, config.response_ttl_s))

    @app.post("/v1/responses", responses={200: {"description": "A response object, or its events"}, **_ERRORS})
    async def create(body: ResponsesRequest, request: Request) -> Response:
        """A model response (OpenAI's Responses API), run as a chat completion; ``previous_response_id``
        continues a stored one (docs/RESPONSES.md)."""

        async def run_chat(chat: dict[str, Any]) -> Response:
            try:
                req = p.ChatCompletionRequest.model_validate_json(json.dumps(chat))
            except ValidationError as exc:
                message, param, code = validation_message(list(exc.errors()))
                return error_response(400, message, "invalid_request_error", param=param, code=code)
            return await serving(request).chat(req, request)

        return await service.create(body, request_owner(request), run_chat)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def retrieve(request: Request, response_id: ResponseIdPath) -> Response:
        """A stored response, to the key that made it."""
        return await service.retrieve(request_owner(request), response_id)

    @app.delete("/v1/responses/{response_id}", responses=_ERRORS)
    async def delete(request: Request, response_id: ResponseIdPath) -> Response:
        """Delete a stored response (the key that made it only)."""
        return await service.delete(request_owner(request), response_id)
