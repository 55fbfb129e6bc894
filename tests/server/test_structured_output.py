"""Structured output through the official openai client against the shared server (tiny random-weight
model): every output matches its schema, regex or choice because the grammar masks the logits."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.structured_cases import SCHEMAS, run_schema_requests


def test_fifty_json_schema_requests_validate(server_url: str, model_name: str) -> None:
    run_schema_requests(server_url, model_name, 50, max_tokens=200)


def test_choice_regex_and_plain_requests_in_one_batch(server_url: str, model_name: str) -> None:
    choices = ["yes", "no", "it depends"]
    pattern = r"[A-Z]{2}-[0-9]{3}"

    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0) as c:
            jobs = []
            for i in range(6):
                jobs.append(c.completions.create(model=model_name, prompt="Answer:", max_tokens=30, seed=i,
                                                 extra_body={"guided_choice": choices}))
                jobs.append(c.chat.completions.create(
                    model=model_name, messages=[{"role": "user", "content": "A code?"}], max_tokens=30, seed=i,
                    extra_body={"structured_outputs": {"regex": pattern}}))
                jobs.append(c.completions.create(model=model_name, prompt="Free:", max_tokens=8, seed=i,
                                                 extra_body={"ignore_eos": True}))
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for i in range(0, len(results), 3):
        choice, regex, plain = results[i:i + 3]
        assert choice.choices[0].text in choices and choice.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, regex.choices[0].message.content), regex.choices[0].message.content
        assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 8


def test_n_completions_and_streaming_each_follow_the_schema(client: openai.OpenAI, model_name: str) -> None:
    schema = SCHEMAS[2]
    kw = dict(model=model_name, prompt="Shirt:", max_tokens=120, n=3, temperature=1.0, seed=3,
              extra_body={"guided_json": schema})
    full = client.completions.create(**kw)
    assert len(full.choices) == 3
    for c in full.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in full.choices}  # same seed, same masks


def test_json_object_and_grammar(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "JSON please"}],
                                       max_tokens=200, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # any object: a random model may not close it within 200 tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    g = client.completions.create(model=model_name, prompt="Count:", max_tokens=40, seed=1, extra_body={
        "structured_outputs": {"grammar": 'root ::= "one" (", " ("two" | "three"))*  "."'}})
    assert re.fullmatch(r"one(, (two|three))*\.", g.choices[0].text)


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema", "bogus"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "not defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "Only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"guided_json": {"type": "object", "description": "x" * 70_000}}, "guided_json", "over the limit"),
])
def test_bad_constraints_are_400_naming_the_problem(server_url: str, model_name: str, body: dict, param: str,
                                                    fragment: str) -> None:
    r = httpx.post(f"{server_url}/v1/chat/completions", timeout=30, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
