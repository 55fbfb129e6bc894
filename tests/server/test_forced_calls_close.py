"""Tool calls that always close: a forced call (``required`` or named) is generated without free
whitespace, so on the random-weight model every seed gives a call that parses within max_tokens 80
(with the whitespace a JSON grammar allows elsewhere, ``required`` often ran out first)."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import openai
import pytest

from tests.server.test_tool_calls import QUESTION, TIME, WEATHER

SEEDS = range(20)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_every_seed_closes_its_call(client: openai.OpenAI, model_name: str, tool_choice: Any) -> None:
    def call(seed: int) -> Any:
        return client.chat.completions.create(model=model_name, messages=QUESTION, tools=[WEATHER, TIME],
                                              tool_choice=tool_choice, max_tokens=80, seed=seed, temperature=1.0)

    # All seeds at once: one batch of 20 decodes in the steps one wave of four took (there were five).
    with concurrent.futures.ThreadPoolExecutor(len(SEEDS)) as pool:
        answers = list(pool.map(call, SEEDS))
    closed = 0
    for r in answers:
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "tool_calls" and calls and all(
                isinstance(json.loads(c.function.arguments), dict) for c in calls):
            closed += 1
    assert closed == len(SEEDS), [(r.choices[0].finish_reason, r.usage.completion_tokens) for r in answers]


def test_the_call_is_written_compactly(client: openai.OpenAI, model_name: str) -> None:
    """Streamed, the arguments are the model's own text: no whitespace between the JSON's tokens."""
    for seed in range(3):
        raw = "".join(tc.function.arguments or "" for chunk in client.chat.completions.create(
            model=model_name, messages=QUESTION, tools=[TIME], max_tokens=40, seed=seed, temperature=1.0, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
            for choice in chunk.choices for tc in choice.delta.tool_calls or [])
        assert raw in ('{"zone":"UTC"}', '{"zone":"CET"}'), raw
