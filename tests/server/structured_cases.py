"""JSON schemas for the structured-output tests: objects, arrays, enums, nesting, required fields.

Every string, array and number is bounded (maxLength, maxItems, enums, ranges), so even a
random-weight model reaches the end of the document well within max_tokens: the grammar, not the
model, decides what comes out.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"enum": ["S", "M", "L"]}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "email": {"type": "string", "maxLength": 16}},
                 "required": ["id"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
     "required": ["user", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
                                                                            "maximum": 1},
                                      "note": {"type": "string", "maxLength": 8}},
     "required": ["ok", "score"], "additionalProperties": False},
]
PROMPTS = ["Give a person as JSON.", "List some numbers.", "Pick a shirt.", "Describe a user.", "Rate it."]


async def _one(client: openai.AsyncOpenAI, model: str, i: int, stream: bool, max_tokens: int) -> tuple[str, str]:
    schema = SCHEMAS[i % len(SCHEMAS)]
    kw: dict[str, Any] = dict(
        model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens,
        temperature=0.7, seed=i,
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema,
                                                                "strict": True}})
    if not stream:
        r = await client.chat.completions.create(**kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", ""
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def run_schema_requests(url: str, model: str, count: int, max_tokens: int) -> None:
    """``count`` concurrent chat requests with a json_schema response format, half streamed; every
    output must finish with "stop", parse, and validate against its schema."""
    async def main() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(_one(client, model, i, i % 2 == 1, max_tokens) for i in range(count)))

    results = asyncio.run(main())
    for i, (text, finish) in enumerate(results):
        assert finish == "stop", (i, finish, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
