"""Tool calling through the official openai client (shared tiny random-weight server, started with
--enable-auto-tool-choice and the default hermes parser), and the parsers on their own."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pagedserve.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, ParsedCall, StreamingToolCalls

# Bounded arguments, so a random model closes the call well within max_tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, dict]], str | None]:
    """Reassemble a streamed answer as the openai client's users do: content, tool calls by index."""
    content, parts, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                part = parts.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                part["id"] = tc.id or part["id"]
                part["name"] += (tc.function.name or "") if tc.function else ""
                part["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    assert all(p["id"] for p in parts.values())
    return content, [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())], finish


def test_two_turn_get_weather_streamed_and_not(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
              parallel_tool_calls=False, max_tokens=120, temperature=0)
    first = client.chat.completions.create(**kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _calls(choice.message)
    assert len(calls) == 1 and calls[0][0] in ("get_weather", "get_time")
    content, streamed, finish = _stream(client, **kw)
    assert streamed == calls and finish == "tool_calls" and not content
    # Turn two: the call and its result go back through the chat template.
    call = choice.message.tool_calls[0]
    messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER, TIME],
                                            tool_choice="none", max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.content
    assert second.choices[0].message.tool_calls == []
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result were rendered


@pytest.mark.parametrize("seed", range(4))
def test_required_and_named_always_parse(client: openai.OpenAI, model_name: str, seed: int) -> None:
    named = client.chat.completions.create(
        model=model_name, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=100, temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (name, args), = _calls(named.choices[0].message)
    assert name == "get_weather" and set(args) == {"city", "unit"} and len(args["city"]) <= 10
    required = client.chat.completions.create(model=model_name, messages=QUESTION, tools=[TIME], max_tokens=60,
                                              temperature=1.0, seed=seed, tool_choice="required",
                                              parallel_tool_calls=False)
    assert _calls(required.choices[0].message)[0][0] == "get_time"
    assert required.choices[0].finish_reason == "tool_calls"


def test_auto_reads_hermes_calls_streamed_and_not(client: openai.OpenAI, model_name: str) -> None:
    # A random model never writes a call by itself: a regex makes it write one in Hermes' format,
    # after some content, and the auto parser has to find it in the text.
    regex = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "celsius"\}\}</tool_call>'
    kw = dict(model=model_name, messages=QUESTION, tools=[WEATHER], max_tokens=80, temperature=0.5, seed=11,
              extra_body={"structured_outputs": {"regex": regex}})
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and msg.content == "Sure. "
    (name, args), = _calls(msg)
    assert name == "get_weather" and args["unit"] == "celsius"
    content, streamed, finish = _stream(client, **kw)
    assert (content, streamed, finish) == ("Sure. ", _calls(msg), "tool_calls")
    plain = client.chat.completions.create(model=model_name, messages=QUESTION, tools=[WEATHER], max_tokens=5,
                                           extra_body={"ignore_eos": True, "guided_regex": "[a-z]{5,9}"})
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
])
def test_bad_tool_requests_are_400(server_url: str, model_name: str, body: dict, param: str) -> None:
    r = httpx.post(f"{server_url}/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": QUESTION, "max_tokens": 4, "tools": [WEATHER], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def _feed_by_character(parser: Any, text: str) -> tuple[str, list[ParsedCall]]:
    stream, content, calls = StreamingToolCalls(parser), "", []
    for i in range(1, len(text) + 1):
        delta, new = stream.feed(text[:i], finished=i == len(text))
        content += delta
        calls += new
    return content, calls


@pytest.mark.parametrize("parser, text, content, calls", [
    (HermesToolParser(), 'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                         '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "Let me check. ", [ParsedCall("f", '{"a": 1}'), ParsedCall("g", "{}")]),
    (HermesToolParser(), "No call, just a < sign and <tool", "No call, just a < sign and <tool", []),
    (HermesToolParser(), "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}',
     None, [ParsedCall("f", '{"x": "y"}'), ParsedCall("g", "{}")]),
    (Llama3JsonToolParser(), "Plain {answer}", "Plain {answer}", []),
])
def test_parsers_streamed_equal_whole(parser: Any, text: str, content: str | None, calls: list) -> None:
    assert parser.parse(text) == (content, calls)
    streamed_content, streamed_calls = _feed_by_character(parser, text)
    assert streamed_calls == calls
    assert streamed_content == (content or "")
