"""A streamed chat completion as the Responses API's typed events.

``response.created`` and ``response.in_progress`` when the first chunk arrives; the text as a
``message`` output item (``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` …, then the ``.done`` events), each tool call as a
``function_call`` item (``response.function_call_arguments.delta`` as its arguments arrive); at
the end ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it) with
the whole response object, which :attr:`ResponsesStream.final` also holds for the store. A chat
error event becomes an ``error`` event. Every event has its ``sequence_number``.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.apis import responses_translate as rt
from pagedserve.apis.relay import ChatChunks


class ResponsesStream:
    """Chat SSE text in, Responses SSE text out (one instance per response)."""

    def __init__(self, base: dict[str, Any]):
        self.base = base  # the skeleton response object (status in_progress)
        self.final: dict[str, Any] | None = None  # the completed response, once known
        self._chunks = ChatChunks()
        self._seq = 0
        self._started = self._ended = False
        self._output: list[dict[str, Any]] = []  # finished items
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index → its item
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._model: str | None = None

    def feed(self, text: str) -> str:
        return "".join(self._on(e) for e in self._chunks.feed(text))

    def end(self) -> str:
        out = "".join(self._on(e) for e in self._chunks.flush())
        if not self._ended:
            self._ended = True
            out += self._start() + self._event("error", {"code": "incomplete", "param": None, "message":
                                                         "The response is incomplete: the stream ended early."})
        return out

    def _event(self, kind: str, fields: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _start(self) -> str:
        if self._started:
            return ""
        self._started = True
        return (self._event("response.created", {"response": self.base})
                + self._event("response.in_progress", {"response": self.base}))

    def _on(self, event: Any) -> str:
        if self._ended:
            return ""
        if event == "[DONE]":
            return self._complete()
        if not isinstance(event, dict):
            return ""
        if isinstance(event.get("error"), dict):
            self._ended = True
            err = event["error"]
            return self._start() + self._event("error", {"code": err.get("code"), "message": err.get("message"),
                                                         "param": err.get("param")})
        out = self._start()
        self._model = event.get("model") or self._model
        if isinstance(event.get("usage"), dict):
            self._usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def _add(self, item: dict[str, Any]) -> str:
        out = self._close()
        self._open = item
        return out + self._event("response.output_item.added", {"output_index": len(self._output), "item": item})

    def _text(self, delta: str) -> str:
        out = ""
        if self._open is None or self._open["type"] != "message":
            item = rt.message_item(rt.new_id("msg"), "", "in_progress")
            out += self._add(item)
            item["_text"] = ""
            out += self._event("response.content_part.added", {
                "item_id": item["id"], "output_index": len(self._output), "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
        assert self._open is not None
        self._open["_text"] += delta
        return out + self._event("response.output_text.delta", {
            "item_id": self._open["id"], "output_index": len(self._output), "content_index": 0, "delta": delta,
            "logprobs": []})

    def _call(self, call: dict[str, Any]) -> str:
        out = ""
        fn = call.get("function") or {}
        index = call.get("index", 0)
        item = self._calls.get(index)
        if item is None:
            item = rt.call_item(rt.new_id("fc"), call.get("id") or rt.new_id("call"), fn.get("name") or "", "",
                                "in_progress")
            self._calls[index] = item
            out += self._add(item)
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out += self._event("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": len(self._output), "delta": fn["arguments"]})
        return out

    def _close(self) -> str:
        item, self._open = self._open, None
        if item is None:
            return ""
        index = len(self._output)
        if item["type"] == "message":
            text = item.pop("_text")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = self._event("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                             "content_index": 0, "text": text, "logprobs": []})
            out += self._event("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                               "content_index": 0, "part": part})
            done = rt.message_item(item["id"], text)
        else:
            out = self._event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]})
            done = {**item, "status": "completed"}
        self._output.append(done)
        return out + self._event("response.output_item.done", {"output_index": index, "item": done})

    def _complete(self) -> str:
        self._ended = True
        out = self._start() + self._close()
        self.final = rt.finished(self.base, self._output, self._finish, self._usage, self._model)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": self.final})
