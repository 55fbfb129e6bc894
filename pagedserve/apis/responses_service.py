"""The Responses API over a chat-completion runner and a :class:`ResponseStore`: create (expanding
``previous_response_id`` into the whole conversation), retrieve, delete. The server runs the chat
completion in process, the gateway through its tiers to a replica; both hand this class a
``run_chat(body)`` and the owner (the API key's digest) of the request.

Errors are OpenAI's body: an unknown, expired or another key's response id is a 404
``not_found_error`` (never telling which); a store that cannot be reached is a 503.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.apis import responses_translate as rt
from pagedserve.apis.anthropic_translate import TranslationError
from pagedserve.apis.relay import kept_headers, translated
from pagedserve.apis.response_store import ResponseStore, StoreUnavailable
from pagedserve.apis.responses_protocol import ResponsesRequest
from pagedserve.apis.responses_stream import ResponsesStream

log = logging.getLogger(__name__)

RunChat = Callable[[dict[str, Any]], Awaitable[Response]]


def openai_error(status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                        status, headers=headers)


def not_found(response_id: str) -> JSONResponse:
    return openai_error(404, f"No response with id '{response_id}' found (it may have expired, or belong to "
                             "another API key).", "not_found_error", param="response_id", code="response_not_found")


def store_down(exc: StoreUnavailable) -> JSONResponse:
    return openai_error(503, f"{exc}; retry shortly.", "server_error", code="response_store_unavailable",
                        headers={"Retry-After": "1"})


def _passed_on(status: int, body: Any) -> dict[str, Any]:
    """The chat side's error body is already OpenAI's."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    return {"error": {"message": "the request failed", "type": "server_error", "param": None, "code": None}}


class ResponsesService:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` over one store."""

    def __init__(self, store: ResponseStore):
        self.store = store

    async def _history(self, owner: str, previous: str | None) -> list[dict[str, Any]] | Response:
        if previous is None:
            return []
        try:
            record = await self.store.get(owner, previous)
        except StoreUnavailable as exc:
            return store_down(exc)
        if record is None:
            return not_found(previous)
        return list(record["input"]) + list(record["response"]["output"])

    async def create(self, req: ResponsesRequest, owner: str, run_chat: RunChat) -> Response:
        history = await self._history(owner, req.previous_response_id)
        if isinstance(history, Response):
            return history
        items = history + rt.input_items(req)
        try:
            body = rt.chat_body(req, items)
        except TranslationError as exc:
            return openai_error(400, exc.message, "invalid_request_error", param=exc.param, code="invalid_value")
        answer = await run_chat(body)
        response_id = rt.new_id("resp")

        async def keep(obj: dict[str, Any]) -> None:
            if not req.store:
                return
            try:
                await self.store.put(owner, response_id, {"response": obj, "input": items})
            except StoreUnavailable as exc:  # the answer still goes out; only its follow-ups will miss it
                log.warning("response %s not stored: %s", response_id, exc)

        if isinstance(answer, StreamingResponse):
            return await translated(answer, lambda c: c, lambda: ResponsesStream(rt.skeleton(req, response_id, None)),
                                    _passed_on, on_final=keep)
        if answer.status_code != 200:
            return answer
        obj = rt.response(req, response_id, json.loads(bytes(answer.body)))
        await keep(obj)
        return JSONResponse(obj, 200, headers=kept_headers(answer))

    async def retrieve(self, owner: str, response_id: str) -> Response:
        try:
            record = await self.store.get(owner, response_id)
        except StoreUnavailable as exc:
            return store_down(exc)
        return JSONResponse(record["response"]) if record is not None else not_found(response_id)

    async def delete(self, owner: str, response_id: str) -> Response:
        try:
            found = await self.store.delete(owner, response_id)
        except StoreUnavailable as exc:
            return store_down(exc)
        if not found:
            return not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
