"""Anthropic's Messages API through the gateway (two real tiny replicas), with the official
``anthropic`` SDK: its key (x-api-key) picks the tier, the request is served as a chat completion
(buckets, seats, shedding), and every refusal answers in Anthropic's shape. And the Responses API
through the same gateway (its in-memory store): charged like chat, kept per key, refusals in
OpenAI's shape."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from pagedserve.gateway.config import parse_config
from tests.gateway.conftest import ENGINE_SEATS, MODEL
from tests.gateway.gateway_server import GatewayThread, bucket_levels, metric

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def gateway(engines: dict[str, str]) -> Iterator[GatewayThread]:
    config = parse_config(f"""
[gateway]
load_poll_interval_s = 0.1
default_service_s = 2.0

[pools.shared]
replicas = ["{engines['shared']}"]

[tiers.meter]
token_rate = 0.001
token_burst = 100000
pools = ["shared"]
priority = 0
max_queue_wait_s = 5.0

[tiers.free]
token_rate = 1000
token_burst = 100000
pools = ["shared"]
priority = 10
max_queue_wait_s = 0.001

[keys]
"sk-meter" = "meter"
"sk-free" = "free"
""")
    with GatewayThread(config) as gw:
        yield gw


def _client(gw: GatewayThread, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=60)


def test_plain_streamed_and_tools_through_the_gateway(gateway: GatewayThread) -> None:
    before = bucket_levels(gateway, "sk-meter")[0]
    with _client(gateway, "sk-meter") as client:
        whole = client.messages.create(model=MODEL, max_tokens=6, messages=QUESTION, extra_body={"temperature": 0})
        with client.messages.stream(model=MODEL, max_tokens=6, messages=QUESTION,
                                    extra_body={"temperature": 0}) as stream:
            streamed = stream.get_final_message()
        call = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, tools=[WEATHER],
                                      tool_choice={"type": "tool", "name": "get_weather"})
        counted = client.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert streamed.content[0].text == whole.content[0].text and whole.stop_reason == streamed.stop_reason
    assert call.stop_reason == "tool_use" and call.content[-1].type == "tool_use"
    total = lambda m: m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + m.usage.output_tokens  # noqa
    assert counted.input_tokens == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    # The bucket was charged exactly what the three answers used (the rate's refill is noise).
    used = total(whole) + total(streamed) + total(call)
    assert abs(before - bucket_levels(gateway, "sk-meter")[0] - used) < 1
    assert metric(gateway.url, "pagedserve_gateway_reconciled_total", tier="meter", outcome="usage") == 3


def test_bad_key_and_bad_field_in_anthropic_shape(gateway: GatewayThread) -> None:
    with _client(gateway, "sk-wrong") as bad, pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with _client(gateway, "sk-meter") as client, pytest.raises(anthropic.BadRequestError) as e2:
        client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION, extra_body={"top_k": -3})
    assert e2.value.body["type"] == "error" and "top_k" in e2.value.body["error"]["message"]  # type: ignore[index]


def test_shed_is_429_with_retry_after_in_anthropic_shape(gateway: GatewayThread) -> None:
    """Free's queue budget is ~0: with every seat taken, a Messages request is shed before any engine work."""
    free = {"Authorization": "Bearer sk-free"}
    long_body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as stack, httpx.Client(base_url=gateway.url, timeout=30) as c:
        for _ in range(ENGINE_SEATS):
            r = stack.enter_context(c.stream("POST", "/v1/chat/completions", json=long_body, headers=free))
            assert r.status_code == 200
        with _client(gateway, "sk-free") as client, pytest.raises(anthropic.RateLimitError) as e:
            client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    assert e.value.status_code == 429 and e.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert metric(gateway.url, "pagedserve_gateway_shed_total", tier="free", reason="overloaded") >= 1


def test_responses_through_the_gateway(gateway: GatewayThread) -> None:
    before = bucket_levels(gateway, "sk-meter")[0]
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-meter", max_retries=0, timeout=60) as client:
        first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4)
        second = client.responses.create(model=MODEL, input="Name?", previous_response_id=first.id,
                                         max_output_tokens=4)
        assert client.responses.retrieve(second.id).output_text == second.output_text
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model=MODEL, input="x", reasoning={"effort": "low"})
        assert "reasoning" in str(bad.value)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    used = first.usage.total_tokens + second.usage.total_tokens
    assert abs(before - bucket_levels(gateway, "sk-meter")[0] - used) < 1
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-free", max_retries=0, timeout=60) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-nobody", max_retries=0, timeout=60) as nobody:
        with pytest.raises(openai.AuthenticationError):
            nobody.responses.retrieve(first.id)
