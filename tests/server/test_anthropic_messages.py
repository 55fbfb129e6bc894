"""Anthropic's Messages API through the official ``anthropic`` SDK, unchanged, against a real server
(tiny random-weight model, with an API key, which the SDK sends as x-api-key); every test leaves
the server without a KV block in use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import NO_KEEP_ALIVE, SDK_SERVER_KEY as KEY
from tests.helpers.servers import wait_for_idle
from tests.server.test_disconnect import aborted_total

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                            "required": ["city"], "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(sdk_server: str) -> Iterator[anthropic.Anthropic]:
    """One per module: a new client builds an SSL context (the root conftest's ``http`` says why)."""
    with anthropic.Anthropic(base_url=sdk_server, api_key=KEY, max_retries=0, timeout=60,
                             http_client=anthropic.DefaultHttpxClient(limits=NO_KEEP_ALIVE)) as c:
        yield c


def test_plain_message(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=QUESTION,
                                 extra_body={"temperature": 0}, metadata={"user_id": "u-1"})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.model == "tiny"
    assert len(msg.content) == 1 and msg.content[0].type == "text"
    assert msg.usage.output_tokens == 8 or msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 10


def test_stream_equals_non_streamed_and_prefix_cache_reads(client: anthropic.Anthropic) -> None:
    # This SDK sends the sampling fields through extra_body (its create() no longer names them).
    kw: dict[str, Any] = dict(model="tiny", max_tokens=12, messages=QUESTION,
                              extra_body={"temperature": 0, "top_k": 5, "top_p": 0.9})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # The second run of the same prompt read its full blocks from the prefix cache.
    assert (final.usage.cache_read_input_tokens or 0) > 0
    total = lambda m: m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)  # noqa: E731
    assert total(final) == total(whole)


def test_raw_event_sequence(sdk_server: str) -> None:
    body = {"model": "tiny", "max_tokens": 5, "stream": True, "messages": QUESTION}
    with httpx.stream("POST", f"{sdk_server}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"]
    assert events[2] == "content_block_start" and events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_use_then_tool_result_then_answer(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model="tiny", max_tokens=60, messages=QUESTION, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str) and call.id.startswith("toolu_")
    with client.messages.stream(model="tiny", max_tokens=60, messages=QUESTION, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    history = QUESTION + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": [
                              {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'},
                              {"type": "text", "text": "And now the answer?"}]}]
    answer = client.messages.create(model="tiny", max_tokens=6, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.content[0].type == "text"
    # The tool's result reached the prompt: it is longer than the first turn's.
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) > \
        first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)


def test_any_tool_closes_its_call_streamed_or_not(client: anthropic.Anthropic) -> None:
    """tool_choice any (chat's required): the call is generated compactly and closes within the budget."""
    kw: dict[str, Any] = dict(model="tiny", max_tokens=80, messages=QUESTION, tools=[WEATHER],
                              tool_choice={"type": "any", "disable_parallel_tool_use": True},
                              extra_body={"temperature": 0})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in whole.content if b.type == "tool_use"]
    assert kinds.count("content_block_delta") > 2  # the arguments came in pieces


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="tiny", max_tokens=16, messages=QUESTION, extra_body={"temperature": 0})
    text = whole.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), "the random model's output has no text to stop on"
    cut = client.messages.create(model="tiny", max_tokens=16, messages=QUESTION, stop_sequences=[stop],
                                 extra_body={"temperature": 0})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text) and len(cut.content[0].text) < len(text)


def test_count_tokens(client: anthropic.Anthropic, sdk_server: str) -> None:
    counted = client.messages.count_tokens(model="tiny", messages=QUESTION, system="Be brief.")
    msg = client.messages.create(model="tiny", max_tokens=1, messages=QUESTION, system="Be brief.")
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    with_tools = client.messages.count_tokens(model="tiny", messages=QUESTION, tools=[WEATHER])
    assert with_tools.input_tokens > 0


def test_bad_key_is_401_in_anthropic_shape(sdk_server: str) -> None:
    with anthropic.Anthropic(base_url=sdk_server, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="tiny", max_tokens=4, messages=QUESTION)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"  # type: ignore[index]
    assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


@pytest.mark.parametrize("extra, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 1.5}, "temperature"), ({"thinking": {"type": "enabled"}},
                                                                                 "thinking"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi\u0000"}]}, "content"),
    ({"model": "claude-other"}, "model"),
    # This server has neither --enable-auto-tool-choice nor a template showing a tool-call format.
    ({"tool_choice": {"type": "auto"}, "tools": [WEATHER]}, "tool_choice"),
])
def test_bad_fields_are_400_in_anthropic_shape(sdk_server: str, extra: dict[str, Any], field: str) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": QUESTION, **extra}
    r = httpx.post(f"{sdk_server}/v1/messages", json=body,
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=30)
    assert r.status_code in (400, 404), r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error", "not_found_error"), err
    assert field.split("[")[0].split(".")[0] in err["error"]["message"], err


def test_sdk_raises_bad_request(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": ""}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    json.dumps(e.value.body)


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"model": "tiny", "max_tokens": 400, "stream": True, "messages": QUESTION}),
    ("/v1/responses", {"model": "tiny", "max_output_tokens": 400, "stream": True, "input": "Go on."}),
])
def test_client_leaving_mid_stream_aborts_the_request(sdk_server: str, path: str, body: dict[str, Any]) -> None:
    """The translated stream keeps the chat stream's cleanup: the engine request is aborted (the
    autouse check then finds no KV block in use)."""
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    before = aborted_total(sdk_server)
    with httpx.stream("POST", f"{sdk_server}{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any(line.startswith("data:") for line in (next(lines), next(lines)))
    load = wait_for_idle(sdk_server, timeout=15)
    assert load["running"] == 0 and load["kv_blocks_used"] == 0, load
    assert aborted_total(sdk_server) == before + 1  # aborted, not run to its end
