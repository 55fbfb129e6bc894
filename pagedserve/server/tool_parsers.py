"""A model's text → OpenAI tool calls, for the formats chat templates teach models to write.

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, possibly after some text, which is the message's content.
- ``llama3_json`` (Llama 3.1+ JSON tool calling): the whole output is ``{"name": ...,
  "parameters": {...}}`` (optionally after ``<|python_tag|>``), several joined by ``;``.

``parse(text)`` gives ``(content, calls)``. For streaming, :class:`StreamingToolCalls` is fed the
text so far and returns the content that can go out now (never a piece that might turn out to
open a tool call) and the calls completed since the last feed; at the end it has produced exactly
what ``parse`` gives for the whole text, so the client's reassembled message equals the
non-streamed one.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


def _call(obj: Any, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(abc.ABC):
    """One model family's tool-call format: split an output into its content and its calls."""

    name = ""

    @abc.abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The content (None when only whitespace) and the calls in a whole output."""

    @abc.abstractmethod
    def content_safe_len(self, text: str) -> int:
        """How much of ``text`` (the output so far) is content whatever comes next."""


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = []
        for m in self._BLOCK.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[:text.index(self.OPEN)]
        return (content if content.strip() else None), calls

    def content_safe_len(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        # Hold back a tail that could be the start of "<tool_call>".
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls

    def content_safe_len(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.TAG) or self.TAG.startswith(body):
            return 0  # may be a call: wait for the end
        return len(text)


PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)}


@dataclass
class StreamingToolCalls:
    """One streamed choice's text split into content deltas and completed calls."""

    parser: ToolParser
    content_sent: int = 0  # characters of the text that went out as content
    calls: list[ParsedCall] = field(default_factory=list)  # the calls that went out

    def feed(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        """``text``: the whole output so far. Returns (content delta, newly completed calls)."""
        if finished:
            content, calls = self.parser.parse(text)
            target = len(text) if not calls else len(content or "")
        else:
            target = self.parser.content_safe_len(text)
            # Hermes blocks are complete as soon as they close; a Llama-3 output only at its end.
            calls = self.parser.parse(text)[1] if isinstance(self.parser, HermesToolParser) else []
        delta = text[self.content_sent:target] if target > self.content_sent else ""
        self.content_sent = max(self.content_sent, target)
        new = calls[len(self.calls):]
        if len(calls) > len(self.calls):
            self.calls = calls
        return delta, new
