"""Anthropic Messages ⇄ OpenAI chat completions: the request becomes a chat body, the chat answer
(one JSON body, or its server-sent chunks) becomes Anthropic's message or event sequence.

What maps to what:

* ``system`` → a first system message; text blocks are joined; ``tool_use`` blocks of an
  assistant message → its ``tool_calls``; each ``tool_result`` block of a user message → a
  ``tool`` message (``is_error`` prefixes its text with ``Error:``), then the message's text.
* ``tool_choice`` auto/any/tool/none → ``auto`` / ``required`` / a named function / ``none``;
  ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``; ``stop_sequences`` → ``stop``;
  ``metadata.user_id`` → ``user``.
* finish ``stop`` → ``end_turn`` (or ``stop_sequence`` when one of ``stop_sequences`` ended it),
  ``length`` → ``max_tokens``, ``tool_calls`` → ``tool_use``.
* usage: ``input_tokens`` are the prompt tokens not read from the prefix cache,
  ``cache_read_input_tokens`` those that were (Anthropic counts them apart).
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.apis.anthropic_protocol import InputMessage, MessagesRequest, TextBlock, ToolResultBlock, ToolUseBlock

# Anthropic's error type for each status the chat side answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error", 500: "api_error", 502: "api_error",
               503: "overloaded_error", 504: "api_error"}


class TranslationError(ValueError):
    """A request that is valid JSON for the schema but cannot be a conversation (a 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an answer of ``status``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def from_openai_error(status: int, body: Any) -> dict[str, Any]:
    """An OpenAI error body (``{"error": {"message", "param", ...}}``) in Anthropic's shape."""
    err = body.get("error") if isinstance(body, dict) else None
    message = str(err.get("message")) if isinstance(err, dict) else "the request failed"
    param = err.get("param") if isinstance(err, dict) else None
    if param and param not in message:
        message = f"{message} (field: {param})"
    return error_body(status, message)


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _chat_messages(m: InputMessage, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user message with tool results becomes several)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise TranslationError("tool_use blocks belong in assistant messages.", where)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise TranslationError("tool_result blocks belong in user messages.", where)
            text = _text(block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else (text or "(no output)")})
    text = "".join(texts)
    if m.role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        return [message]
    if not results and not text:
        raise TranslationError(f"messages[{i}].content must not be empty.", f"messages[{i}].content")
    return results + ([{"role": "user", "content": text}] if text else [])


def chat_messages(req: Any) -> list[dict[str, Any]]:
    """The conversation (system prompt first) as chat messages."""
    messages: list[dict[str, Any]] = []
    system = _text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages.extend(_chat_messages(m, i))
    return messages


def chat_tools(req: Any) -> dict[str, Any]:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of the chat body."""
    out: dict[str, Any] = {}
    if req.tools:
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return out
    if choice.name is not None and choice.type != "tool":
        raise TranslationError('tool_choice.name goes only with type "tool".', "tool_choice.name")
    if choice.type == "tool":
        if choice.name is None:
            raise TranslationError('tool_choice of type "tool" needs the name of the tool.', "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use and choice.type != "none":
        out["parallel_tool_calls"] = False
    return out


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat completions body that runs ``req``."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "max_tokens": req.max_tokens,
                            **chat_tools(req)}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    if req.metadata is not None and req.metadata.user_id:
        body["user"] = req.metadata.user_id
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # message_delta carries the usage
    return body


def stop_reason(finish: str | None, stop: Any, stop_sequences: list[str]) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat finish_reason and vLLM's stop_reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str) and stop in stop_sequences:
        return "stop_sequence", stop
    return "end_turn", None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage from chat usage (cache reads counted apart from the other input tokens)."""
    u = chat_usage or {}
    prompt = int(u.get("prompt_tokens") or 0)
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "output_tokens": int(u.get("completion_tokens") or 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_use_id(chat_id: str | None) -> str:
    """Anthropic's ``toolu_`` id for a chat tool call's ``call_`` id."""
    rest = (chat_id or "").removeprefix("call_")
    return "toolu_" + rest


def tool_input(arguments: str | None) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_id(chat_id: str | None) -> str:
    return "msg_" + (chat_id or "").removeprefix("chatcmpl-")


def message(chat: dict[str, Any], stop_sequences: list[str]) -> dict[str, Any]:
    """A non-streamed chat answer as Anthropic's message."""
    choice = chat["choices"][0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": tool_use_id(call.get("id")), "name": fn.get("name"),
                        "input": tool_input(fn.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences)
    return {"id": message_id(chat.get("id")), "type": "message", "role": "assistant", "model": chat.get("model"),
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat.get("usage"))}
