"""OpenAI's Responses API on the gateway: ``POST /v1/responses`` is expanded here (the store holds
the conversation; ``previous_response_id`` becomes the whole input), translated onto a chat
completion and served like any chat request — tier, bucket, seat, shedding — by whichever replica
the pools pick: replicas stay stateless. ``GET`` / ``DELETE /v1/responses/{id}`` read the store.

With ``--response-store redis://…`` every gateway process shares the store, so the turns of one
conversation may come through different gateways and land on different replicas. Responses are
kept under the digest of the key that made them: another key is answered 404.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedserve.apis.response_store import make_store
from pagedserve.apis.responses_protocol import MAX_RESPONSE_ID_CHARS, ResponsesRequest
from pagedserve.apis.responses_service import ResponsesService, not_found
from pagedserve.apis.validation import first_problem
from pagedserve.gateway.config import GatewayConfig
from pagedserve.gateway.keys import presented_key
from pagedserve.gateway.responses import error_response

CHAT = "/v1/chat/completions"


def _unauthorized() -> JSONResponse:
    return error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with a key "
                          "this gateway knows.", code="invalid_api_key")


def _invalid(exc: ValidationError) -> JSONResponse:
    where, message = first_problem(exc)
    return error_response(400, message, param=where, code="invalid_value")


def install_responses_routes(app: FastAPI, handle: Callable[..., Awaitable[Response]], config: GatewayConfig) -> None:
    """Register the Responses API on the gateway ``app``; ``handle(gw, request, path, body)`` serves a
    chat body. The store is ``app.state.responses.store`` (closed by the app's lifespan)."""
    service = app.state.responses = ResponsesService(make_store(config.response_store, config.response_ttl_s))

    def owner(request: Request) -> str | None:
        entry = request.app.state.gateway.keys.lookup(presented_key(request.headers))
        return entry.digest.hex() if entry is not None else None

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        who = owner(request)
        if who is None:
            return _unauthorized()
        try:
            body = ResponsesRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _invalid(exc)
        gw = request.app.state.gateway

        async def run_chat(chat: dict[str, Any]) -> Response:
            return await handle(gw, request, CHAT, chat)

        return await service.create(body, who, run_chat)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        who = owner(request)
        if who is None:
            return _unauthorized()
        if len(response_id) > MAX_RESPONSE_ID_CHARS:
            return not_found(response_id[:MAX_RESPONSE_ID_CHARS])
        return await service.retrieve(who, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        who = owner(request)
        if who is None:
            return _unauthorized()
        if len(response_id) > MAX_RESPONSE_ID_CHARS:
            return not_found(response_id[:MAX_RESPONSE_ID_CHARS])
        return await service.delete(who, response_id)
