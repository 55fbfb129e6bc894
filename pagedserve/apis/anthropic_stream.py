"""A streamed chat completion as Anthropic's event sequence.

``message_start`` and a ``ping`` when the first chunk arrives; each run of text is a ``text``
content block and each tool call a ``tool_use`` block (``content_block_start``, its deltas —
``text_delta`` or ``input_json_delta`` as the call's arguments arrive — then
``content_block_stop``); at the end ``message_delta`` with the stop reason and the usage, then
``message_stop``. A chat error event becomes an ``error`` event, which ends the stream.

The prompt's token count is known only at the end (it comes with the chat stream's usage chunk):
``message_start`` carries zeros, and ``message_delta``'s usage has every count, which the official
SDK folds into its final message.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.apis import anthropic_translate as t
from pagedserve.apis.relay import ChatChunks


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class AnthropicStream:
    """Chat SSE text in, Anthropic SSE text out (one instance per response)."""

    def __init__(self, model: str, stop_sequences: list[str]):
        self.model = model
        self.stop_sequences = stop_sequences
        self._chunks = ChatChunks()
        self._started = False
        self._ended = False
        self._block: int | None = None  # the index of the open content block
        self._block_kind: str | None = None  # text | tool_use
        self._next = 0  # the next block's index
        self._calls: dict[int, int] = {}  # chat tool-call index → its block
        self._finish: str | None = None
        self._stop: Any = None
        self._usage: dict[str, Any] | None = None

    def feed(self, text: str) -> str:
        return "".join(self._on(e) for e in self._chunks.feed(text))

    def end(self) -> str:
        """What is left when the chat stream ended (its [DONE] normally ended it already)."""
        out = "".join(self._on(e) for e in self._chunks.flush())
        if not self._ended:
            out += self._start("msg_incomplete") + sse("error", t.error_body(
                502, "The response is incomplete: the stream ended before its end. Retry the request."))
            self._ended = True
        return out

    def _start(self, chat_id: str | None) -> str:
        if self._started:
            return ""
        self._started = True
        message = {"id": t.message_id(chat_id), "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def _open(self, kind: str, block: dict[str, Any]) -> str:
        out = self._close()
        self._block, self._block_kind = self._next, kind
        self._next += 1
        return out + sse("content_block_start", {"type": "content_block_start", "index": self._block,
                                                 "content_block": block})

    def _close(self) -> str:
        if self._block is None:
            return ""
        index, self._block, self._block_kind = self._block, None, None
        return sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def _on(self, event: Any) -> str:
        if self._ended:
            return ""
        if event == "[DONE]":
            return self._finish_message()
        if not isinstance(event, dict):
            return ""
        if isinstance(event.get("error"), dict):
            self._ended = True
            err = event["error"]
            status = 503 if err.get("type") == "server_overloaded" else (
                400 if err.get("type") == "invalid_request_error" else 500)
            return self._start(None) + sse("error", t.from_openai_error(status, event))
        out = self._start(event.get("id"))
        if isinstance(event.get("usage"), dict):
            self._usage = event["usage"]
        for choice in event.get("choices") or []:
            out += self._delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self._finish, self._stop = choice["finish_reason"], choice.get("stop_reason")
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        out = ""
        if delta.get("content"):
            if self._block_kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += sse("content_block_delta", {"type": "content_block_delta", "index": self._block,
                                               "delta": {"type": "text_delta", "text": delta["content"]}})
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            index = call.get("index", 0)
            if index not in self._calls:
                out += self._open("tool_use", {"type": "tool_use", "id": t.tool_use_id(call.get("id")),
                                               "name": fn.get("name") or "", "input": {}})
                self._calls[index] = self._next - 1
            if fn.get("arguments"):
                out += sse("content_block_delta", {"type": "content_block_delta", "index": self._calls[index],
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": fn["arguments"]}})
        return out

    def _finish_message(self) -> str:
        self._ended = True
        out = self._start(None) + self._close()
        reason, sequence = t.stop_reason(self._finish, self._stop, self.stop_sequences)
        out += sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": t.usage(self._usage)})
        return out + sse("message_stop", {"type": "message_stop"})
