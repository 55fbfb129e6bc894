"""Structured output and tool calls with the real default model (SmolLM2-135M-Instruct), on the
session's default-model server (``smollm2_server``): the same guarantees as with random weights."""

from __future__ import annotations

import json

import openai

from tests.helpers.servers import wait_for_idle
from tests.server.structured_cases import run_schema_requests

MODEL = "SmolLM2-135M-Instruct"


def test_twenty_json_schema_requests_validate(smollm2_server: str) -> None:
    # Every schema, streamed and not, twice (two seeds each): what the real model adds to the random
    # one's fifty concurrent requests (test_structured_output) is its own choice of tokens.
    run_schema_requests(smollm2_server, MODEL, 20, max_tokens=160)
    assert wait_for_idle(smollm2_server, timeout=30)["kv_blocks_used"] == 0


def test_choice_regex_and_a_named_tool_call(smollm2_server: str) -> None:
    with openai.OpenAI(base_url=f"{smollm2_server}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
            max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].message.content in ("yes", "no")
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a date."}], max_tokens=20, temperature=0,
            extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
        assert len(r.choices[0].message.content) == 10
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[tool],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert wait_for_idle(smollm2_server, timeout=30)["kv_blocks_used"] == 0
