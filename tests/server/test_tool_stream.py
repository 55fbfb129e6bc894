"""Forced tool calls stream their arguments as they are generated: the scanner on its own (fed a
call a character at a time), and through the official openai client on the shared server."""

from __future__ import annotations

import json

import openai

from pagedserve.server.serving_base import ToolMode
from pagedserve.server.tool_stream import ForcedCallStream, completed_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _feed_by_character(stream: ForcedCallStream, text: str) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for end in range(1, len(text) + 1):
        content, deltas = stream.feed(text[:end], end == len(text))
        assert content == ""
        for d in deltas:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    return calls


def test_required_calls_split_by_the_scanner() -> None:
    text = ' [ {"name": "f", "arguments": {"a": "x}]\\"", "b": [1, {"c": 2}]}} ,{"name":"g","arguments":{}}]'
    stream = ForcedCallStream(ToolMode("required"))
    calls = _feed_by_character(stream, text)
    assert [c["name"] for c in calls.values()] == ["f", "g"] and all(c["id"] for c in calls.values())
    assert json.loads(calls[0]["arguments"]) == {"a": 'x}]"', "b": [1, {"c": 2}]} and calls[1]["arguments"] == "{}"
    assert [c.name for c in stream.calls] == ["f", "g"]


def test_named_call_is_its_arguments() -> None:
    stream = ForcedCallStream(ToolMode("named", function="f"))
    calls = _feed_by_character(stream, '{"city": "Paris"}')
    assert calls == {0: {"id": calls[0]["id"], "name": "f", "arguments": '{"city": "Paris"}'}}
    assert stream.calls[0].name == "f"


def test_cut_short_call_has_no_parsed_calls() -> None:
    stream = ForcedCallStream(ToolMode("required"))
    calls = _feed_by_character(stream, '[{"name": "f", "arguments": {"a": "unfinis')
    assert calls[0]["name"] == "f" and stream.calls == []


def test_streamed_named_call_arrives_in_pieces(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, messages=QUESTION, tools=[WEATHER], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    pieces = [tc for chunk in client.chat.completions.create(stream=True, **kw)  # type: ignore[call-overload]
              for choice in chunk.choices for tc in choice.delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    assert len([p for p in pieces if p.function.arguments]) > 2  # not one block
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_completed_calls_of_a_cut_array() -> None:
    cut = '[{"name":"f","arguments":{"a":1}},{"name":"g","arguments":{}},{"name":"f","argu'
    assert [(c.name, json.loads(c.arguments)) for c in completed_calls(cut)] == [("f", {"a": 1}), ("g", {})]
    assert completed_calls('[{"name":"f","argum') == [] and completed_calls("nothing") == []
    content, calls = ToolMode("required").calls(cut)
    assert content is None and [c.name for c in calls] == ["f", "g"]
