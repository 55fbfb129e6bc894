"""A forced tool call's arguments streamed as they are generated, not one block per call.

With ``tool_choice`` ``required`` or a named function the grammar makes the whole output the
call(s): a named call's output is its arguments object; a required call's is
``[{"name": …, "arguments": {…}}, …]`` (name first: the schema lists it first). A small
incremental JSON scanner follows the text as it grows and finds, for each call, its name and
where its arguments value starts and ends; each feed sends the arguments' new characters as a
delta of that call (the first delta carries its id and name). The client's concatenated
arguments are the model's JSON text as written; the calls read at the end (for ``finish_reason``)
are :meth:`ToolMode.calls`'s, as in the non-streamed answer. A ``required`` array that max_tokens
cut short keeps the calls it completed (:func:`completed_calls`); streamed, the call it was
writing when cut was already announced, and its arguments stay incomplete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from pagedserve.server import protocol as p
from pagedserve.server.tool_parsers import ParsedCall


@dataclass
class _Call:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    sent: int = 0  # characters of the arguments already sent
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    announced: bool = False


def completed_calls(text: str) -> list[ParsedCall]:
    """The calls a ``required`` output completed before max_tokens cut its array short: each whole
    ``{"name", "arguments"}`` element, in order, up to the first that is not whole."""
    decoder, calls = json.JSONDecoder(), []
    body = text.lstrip()
    if not body.startswith("["):
        return []
    i = 1
    while True:
        while i < len(body) and body[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return calls
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
            return calls
        calls.append(ParsedCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))


class _CallScanner:
    """Where each call's name and arguments are in ``[{"name": …, "arguments": {…}}, …]``."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._pos = 0
        self._depth = 0
        self._in_string = self._escape = False
        self._string = ""
        self._expect_key = False
        self._key: str | None = None

    def scan(self, text: str) -> None:
        for i in range(self._pos, len(text)):
            self._char(text[i], i)
        self._pos = len(text)

    def _char(self, c: str, i: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                self._string_done()
                return
            self._string += c
            return
        if c == '"':
            self._in_string, self._string = True, ""
        elif c in "{[":
            self._depth += 1
            if self._depth == 2:  # a call object opens in the array
                self.calls.append(_Call())
                self._expect_key = True
            elif self._depth == 3 and self._key == "arguments" and self.calls and self.calls[-1].args_start is None:
                self.calls[-1].args_start = i
        elif c in "}]":
            self._depth -= 1
            if self._depth == 2 and self.calls and self.calls[-1].args_start is not None \
                    and self.calls[-1].args_end is None:
                self.calls[-1].args_end = i + 1
        elif self._depth == 2 and c == ":":
            self._expect_key = False
        elif self._depth == 2 and c == ",":
            self._expect_key, self._key = True, None

    def _string_done(self) -> None:
        if self._depth != 2 or not self.calls:
            return
        if self._expect_key:
            self._key = self._string
        elif self._key == "name" and self.calls[-1].name is None:
            self.calls[-1].name = self._string


class ForcedCallStream:
    """One streamed choice of a forced call (``required`` or named): argument deltas as they come.

    ``mode`` is the request's :class:`~pagedserve.server.serving_base.ToolMode`; ``calls`` holds
    the calls read from the whole output once it finished (empty if it was cut short)."""

    def __init__(self, mode: object):
        self.mode = mode
        self.calls: list[ParsedCall] = []
        self.named = getattr(mode, "kind", "") == "named"
        self._scanner = _CallScanner()
        self._named_call = _Call(name=getattr(mode, "function", None), args_start=0)

    def _active(self, text: str) -> list[_Call]:
        if self.named:
            return [self._named_call]
        self._scanner.scan(text)
        return self._scanner.calls

    def feed(self, text: str, finished: bool) -> tuple[str, list[p.DeltaToolCall]]:
        """``text``: the whole output so far. Returns (content delta: always empty, call deltas)."""
        deltas = []
        for index, call in enumerate(self._active(text)):
            if call.name is None:
                continue
            end = call.args_end if call.args_end is not None else len(text)
            piece = text[call.args_start + call.sent:end] if call.args_start is not None else ""
            if call.args_start is not None:
                call.sent = max(call.sent, end - call.args_start)
            if not call.announced:
                call.announced = True
                deltas.append(p.DeltaToolCall(index=index, id=call.id, type="function",
                                              function=p.DeltaFunctionCall(name=call.name, arguments=piece)))
            elif piece:
                deltas.append(p.DeltaToolCall(index=index, function=p.DeltaFunctionCall(arguments=piece)))
        if finished:
            self.calls = self.mode.calls(text)[1]  # type: ignore[attr-defined]
        return "", deltas
