"""OpenAI Responses ⇄ chat completions: a conversation of input items (the stored chain's, then
the request's own) becomes chat messages; a chat answer becomes a response object.

* message items → chat messages (``developer`` kept, text parts joined); ``instructions`` → a
  first system message (never carried over from a previous response, as OpenAI does);
* ``function_call`` items → ``tool_calls`` of an assistant message (consecutive ones join the
  same message); ``function_call_output`` → a ``tool`` message;
* ``text.format`` → ``response_format``; ``max_output_tokens`` → ``max_tokens``;
* the answer's text → one ``message`` output item, each tool call a ``function_call`` item;
  finish ``length`` → status ``incomplete`` (``max_output_tokens``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagedserve.apis.anthropic_translate import TranslationError
from pagedserve.apis.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as item dicts (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(exclude_none=True) for item in req.input]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "".join(part["text"] for part in content)
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not messages:
        raise TranslationError("input must not be empty.", "input")
    return messages


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise TranslationError('text.format of type "json_schema" needs its schema.', "text.format.schema")
    schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def chat_body(req: ResponsesRequest, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body that runs ``req`` over the whole conversation ``items``."""
    body: dict[str, Any] = {"messages": chat_messages(items, req.instructions)}
    if req.model is not None:
        body["model"] = req.model
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
            "type": "function", "function": {"name": req.tool_choice.name}}
    for ours, theirs in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p"), ("user", "user")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    fmt = _response_format(req)
    if fmt is not None:
        body["response_format"] = fmt
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return body


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The answer's text as an output item (an item just opened has no content part yet)."""
    parts = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                  "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    prompt, completion = int(chat_usage.get("prompt_tokens") or 0), int(chat_usage.get("completion_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def skeleton(req: ResponsesRequest, response_id: str, model: str | None) -> dict[str, Any]:
    """The response object before its output: what the request asked for, status in_progress."""
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model or req.model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "text": req.text.model_dump(exclude_none=True, by_alias=True) if req.text and req.text.format else
        {"format": {"type": "text"}},
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump())
        if req.tool_choice is not None else "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "truncation": "disabled",
        "usage": None, "metadata": dict(req.metadata or {}), "user": req.user,
    }


def finished(base: dict[str, Any], output: list[dict[str, Any]], finish: str | None,
             chat_usage: dict[str, Any] | None, model: str | None) -> dict[str, Any]:
    """The response object once the answer is complete."""
    incomplete = finish == "length"
    return {**base, "status": "incomplete" if incomplete else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": usage(chat_usage), "model": model or base["model"]}


def response(req: ResponsesRequest, response_id: str, chat: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed chat answer as the response object."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if msg.get("content"):
        output.append(message_item(new_id("msg"), msg["content"]))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append(call_item(new_id("fc"), call.get("id") or new_id("call"), fn.get("name") or "",
                                fn.get("arguments") or ""))
    return finished(skeleton(req, response_id, chat.get("model")), output, choice.get("finish_reason"),
                    chat.get("usage"), chat.get("model"))
