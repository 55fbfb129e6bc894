"""``tool_choice: "auto"`` without --enable-auto-tool-choice, on a server whose chat template shows
the Hermes tool-call format (the tiny random model with such a template, given as --chat-template):
the format is read from the template, and the OpenAI and Anthropic APIs both accept "auto"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from pagedserve.server.tool_format import infer_tool_parser
from tests.helpers.servers import run_engine_server, wait_for_idle

HERMES_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tiny_model_dir: Any) -> Iterator[str]:
    with run_engine_server(tiny_model_dir, "--max-model-len", "256", "--num-kv-blocks", "128",
                           "--served-model-name", "tiny", "--chat-template", HERMES_TEMPLATE,
                           "--log-level", "warning", timeout=120) as u:
        yield u
        load = wait_for_idle(u, timeout=15)
        assert load["kv_blocks_used"] == 0 and load["running"] == 0 and load["waiting"] == 0, load


def test_the_format_is_read_from_the_template() -> None:
    assert infer_tool_parser(HERMES_TEMPLATE) == "hermes"
    assert infer_tool_parser("{{ '<|python_tag|>' }}{{ m | tojson }}") == "llama3_json"
    assert infer_tool_parser("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert infer_tool_parser(None) is None


def test_auto_accepted_without_the_flag(url: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        r = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=8)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        # The random model writes no <tool_call> block: the text is the content.
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60) as client:
        msg = client.messages.create(model="tiny", max_tokens=8, messages=QUESTION, tool_choice={"type": "auto"},
                                     tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
        assert msg.stop_reason in ("max_tokens", "end_turn") and msg.content[0].type == "text"
