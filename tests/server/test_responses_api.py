"""OpenAI's Responses API through the official ``openai`` SDK (responses.create / stream / retrieve /
delete) against a real server (tiny random-weight model, in-memory store with a short TTL); every
test leaves the server without a KV block in use."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import NO_KEEP_ALIVE, SDK_SERVER_KEY, SDK_SERVER_RESPONSE_TTL_S as TTL_S

AUTH = {"authorization": f"Bearer {SDK_SERVER_KEY}"}  # raw HTTP sends the key the SDK client sends
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(sdk_server: str) -> Iterator[openai.OpenAI]:
    """One per module: a new client builds an SSL context (the root conftest's ``http`` says why)."""
    with openai.OpenAI(base_url=f"{sdk_server}/v1", api_key=SDK_SERVER_KEY, max_retries=0, timeout=60,
                       http_client=openai.DefaultHttpxClient(limits=NO_KEEP_ALIVE)) as c:
        yield c


def _tokens(url: str, messages: list[dict[str, str]]) -> int:
    return httpx.post(f"{url}/tokenize", json={"messages": messages}, headers=AUTH, timeout=30).json()["count"]


def test_create_retrieve_delete(client: openai.OpenAI, sdk_server: str) -> None:
    r = client.responses.create(model="tiny", input="Say hi.", instructions="Be brief.", max_output_tokens=6,
                                temperature=0, metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text and r.usage.output_tokens == 6
    assert r.usage.input_tokens == _tokens(sdk_server, [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Say hi."}])
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_stream_equals_non_streamed_and_is_stored(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", input=[{"role": "user", "content": "Count."}], max_output_tokens=8,
                              temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    # Cut by max_output_tokens: the last event is response.incomplete (as OpenAI's), carrying the
    # response (the SDK's get_final_response() waits for response.completed only).
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    final = events[-1].response
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_three_turns_by_previous_response_id(client: openai.OpenAI, sdk_server: str) -> None:
    """Each turn's prompt is the whole conversation: its input tokens are exactly the chat template's
    count of every earlier message and answer (the store expanded the chain)."""
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=5, temperature=0)
    second = client.responses.create(model="tiny", input="I live in Paris.", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    third = client.responses.create(model="tiny", input="What is my name?", previous_response_id=second.id,
                                    max_output_tokens=5, temperature=0)
    conversation = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "I live in Paris."},
                    {"role": "assistant", "content": second.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert third.previous_response_id == second.id
    assert third.usage.input_tokens == _tokens(sdk_server, conversation)
    assert second.usage.input_tokens == _tokens(sdk_server, conversation[:3])


def test_function_call_then_output(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=60,
                              tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    first = client.responses.create(**kw)
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert json.loads(streamed.output[-1].arguments) == json.loads(call.arguments)
    answer = client.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=4, input=[
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": '{"temperature": 21}'}])
    assert answer.output[0].type == "message" and answer.usage.input_tokens > first.usage.input_tokens


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Answer in JSON.", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)


def test_expired_response_is_404(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Remember me.", max_output_tokens=2)
    assert client.responses.retrieve(r.id).id == r.id
    deadline = time.monotonic() + TTL_S + 30
    while time.monotonic() < deadline:
        try:
            client.responses.retrieve(r.id)
        except openai.NotFoundError:
            break
        time.sleep(0.25)
    else:
        pytest.fail(f"{r.id} still there {TTL_S + 30}s after it was made")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="And now?", previous_response_id=r.id, max_output_tokens=2)


@pytest.mark.parametrize("extra, status, field", [
    ({"previous_response_id": "resp_nothere"}, 404, "resp_nothere"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"input": []}, 400, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "schema"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]}, 400, "input"),
    ({"previous_response_id": "bad id!"}, 400, "previous_response_id"),
])
def test_bad_fields(sdk_server: str, extra: dict[str, Any], status: int, field: str) -> None:
    r = httpx.post(f"{sdk_server}/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2, **extra},
                   headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    assert field in r.text and set(r.json()["error"]) >= {"message", "type"}
    assert httpx.get(f"{sdk_server}/v1/responses/{'x' * 200}", headers=AUTH, timeout=10).status_code == 400
