"""The gateway in front of real engine servers (the `tiny` model): the official `openai` client,
streaming, 401, 429 with Retry-After and headers, overload shedding, a provisioned pool untouched
by free traffic, exact reconciliation (in-process and Redis buckets)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagedserve.gateway.config import GatewayConfig, parse_config
from pagedserve.gateway.limiter_redis import RedisLimiter
from tests.gateway.conftest import ENGINE_SEATS, MODEL
from tests.gateway.gateway_server import GatewayThread, bucket_levels, metric
from tests.helpers.servers import free_port
from tests.helpers.waiting import wait_until


def _config(engines: dict[str, str]) -> GatewayConfig:
    return parse_config(f"""
[gateway]
load_poll_interval_s = 0.1
default_service_s = 2.0

[pools.dedicated]
replicas = ["{engines['dedicated']}"]

[pools.shared]
replicas = ["{engines['shared']}", "http://127.0.0.1:9"]   # the second one is down: routed around

[tiers.paid]
token_rate = 1000
token_burst = 100000
pools = ["dedicated", "shared"]
priority = 0
max_queue_wait_s = 1.0

[tiers.paidshared]
token_rate = 1000
token_burst = 100000
pools = ["shared"]
priority = 0
max_queue_wait_s = 1.0

[tiers.free]
token_rate = 1000
token_burst = 100000
pools = ["shared"]
priority = 10
max_queue_wait_s = 0.001
default_max_tokens = 16

[tiers.tight]
token_rate = 20
token_burst = 300
pools = ["shared"]
priority = 5
max_queue_wait_s = 5.0

[tiers.meter]
token_rate = 0.001
token_burst = 5000
pools = ["dedicated"]
max_queue_wait_s = 5.0
default_max_tokens = 12

[keys]
"sk-paid" = "paid"
"sk-paidshared" = "paidshared"
"sk-free" = "free"
"sk-tight" = "tight"
"sk-tight-2" = "tight"
"sk-meter" = "meter"
""")


@pytest.fixture(scope="module")
def gateway(engines: dict[str, str]) -> Iterator[GatewayThread]:
    with GatewayThread(_config(engines)) as gw:
        yield gw


def test_openai_client_through_the_gateway(gateway: GatewayThread) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-meter", max_retries=0)
    before = bucket_levels(gateway, "sk-meter")[0]
    r = client.completions.create(model=MODEL, prompt="The paging of memory", max_tokens=8,
                                  extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, extra_body={"ignore_eos": True})
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    # Streaming, with usage asked for: passed through as the last chunk.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream please"}], stream=True, max_tokens=6,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    streamed_usage = chunks[-1].usage.total_tokens
    # Streaming without usage: the gateway still learns it, but the client does not see it.
    plain = list(client.completions.create(model=MODEL, prompt="no usage", max_tokens=4, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in plain) and sum(len(c.choices) for c in plain) >= 4
    # No output cap: the tier's default (12) is written in.
    uncapped = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              extra_body={"ignore_eos": True})
    assert uncapped.usage is not None and uncapped.usage.completion_tokens == 12
    assert [m.id for m in client.models.list().data] == [MODEL]
    # Reconciled exactly: the bucket lost what was used, no more (rate 0.001/s: refill is noise).
    used = r.usage.total_tokens + chat.usage.total_tokens + streamed_usage + uncapped.usage.total_tokens
    wait_until(lambda: metric(gateway.url, "pagedserve_gateway_reconciled_total", tier="meter", outcome="usage") == 5,
               timeout=5, what="all five requests reconciled")
    after = bucket_levels(gateway, "sk-meter")[0]
    plain_used = before - after - used
    assert 0 < plain_used < 40  # the unseen stream's usage: its prompt + 4 tokens


def test_unknown_or_missing_key_is_401(gateway: GatewayThread) -> None:
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert err.value.status_code == 401 and "sk-wrong" not in str(err.value)
    r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_429_with_retry_after_and_ratelimit_headers(gateway: GatewayThread) -> None:
    headers = {"Authorization": "Bearer sk-tight"}
    body = {"model": MODEL, "prompt": "hold the bucket", "max_tokens": 280, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as held:
            assert held.status_code == 200
            assert held.headers["x-ratelimit-limit-tokens"] == "300"
            remaining = int(held.headers["x-ratelimit-remaining-tokens"])
            assert remaining < 20
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "me too", "max_tokens": 100})
            assert r.status_code == 429
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
            assert "limit 300" in err["message"] and "requested 10" in err["message"]
            # Retry-After comes from the refill rate (20 tokens/s), not a constant.
            requested = int(err["message"].split("requested ")[1].split(".")[0])
            expected = (requested - float(r.headers["x-ratelimit-remaining-tokens"])) / 20
            assert abs(int(r.headers["retry-after-ms"]) / 1000 - expected) < 0.2
            assert int(r.headers["Retry-After"]) == max(1, math.ceil(int(r.headers["retry-after-ms"]) / 1000))
            assert r.headers["x-ratelimit-limit-tokens"] == "300"
            assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
        # A request larger than the bucket can ever hold is told so, and not to retry.
        too_big = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 400})
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "tokens_exceed_bucket"
        assert "can never pass" in too_big.json()["error"]["message"]


def test_openai_client_sees_rate_limit_error(gateway: GatewayThread) -> None:
    # Buckets are per key: this key's bucket is full whatever the other tests did with sk-tight.
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-tight-2", max_retries=0)
    with httpx.Client(base_url=gateway.url, headers={"Authorization": "Bearer sk-tight-2"}, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 285,
                                                       "ignore_eos": True, "stream": True}) as held:
            assert held.status_code == 200
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(model=MODEL, prompt="q", max_tokens=50)
            assert err.value.response.headers.get("retry-after") is not None


def test_client_disconnect_refunds_once_and_engine_stops(gateway: GatewayThread, engines: dict[str, str]) -> None:
    before = bucket_levels(gateway, "sk-meter")[0]
    with httpx.Client(base_url=gateway.url, headers={"Authorization": "Bearer sk-meter"}, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "leave early", "max_tokens": 3000,
                                                       "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break
    deadline = time.monotonic() + 10
    while metric(gateway.url, "pagedserve_gateway_reconciled_total", tier="meter", outcome="disconnected") < 1:
        assert time.monotonic() < deadline, "the disconnect was never reconciled"
        time.sleep(0.05)
    used = before - bucket_levels(gateway, "sk-meter")[0]
    assert 0 < used < 200  # charged its prompt + the chunks it got, not the 3,000 reserved
    while httpx.get(f"{engines['dedicated']}/load").json()["running"] > 0:
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)


def test_engine_error_is_passed_through_and_refunded(gateway: GatewayThread) -> None:
    before = bucket_levels(gateway, "sk-meter")[0]
    r = httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": "Bearer sk-meter"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert bucket_levels(gateway, "sk-meter")[0] == pytest.approx(before, abs=0.01)


def test_overload_sheds_free_while_paid_is_served(gateway: GatewayThread) -> None:
    """Free's budget is ~0: once the engine's ENGINE_SEATS seats are taken, the next free request is shed with 429
    ('overloaded', no engine work); paid, with better priority, still goes straight in."""
    free = {"Authorization": "Bearer sk-free"}
    long_body = {"model": MODEL, "prompt": "long", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as stack, httpx.Client(base_url=gateway.url, timeout=30) as c:
        for _ in range(ENGINE_SEATS):
            r = stack.enter_context(c.stream("POST", "/v1/completions", json=long_body, headers=free))
            assert r.status_code == 200
        shed = c.post("/v1/completions", json={"model": MODEL, "prompt": "one more"}, headers=free)
        assert shed.status_code == 429
        assert shed.json()["error"]["code"] == "overloaded" and "budget" in shed.json()["error"]["message"]
        assert float(shed.headers["retry-after-ms"]) > 0 and int(shed.headers["Retry-After"]) >= 1
        assert shed.headers["x-ratelimit-limit-tokens"] == "100000"
        paid = c.post("/v1/completions", json={"model": MODEL, "prompt": "vip", "max_tokens": 4},
                      headers={"Authorization": "Bearer sk-paidshared"})
        assert paid.status_code == 200 and paid.headers["x-pagedserve-pool"] == "shared"
    assert metric(gateway.url, "pagedserve_gateway_shed_total", tier="free", reason="overloaded") >= 1


def test_provisioned_pool_untouched_by_free_traffic(gateway: GatewayThread, engines: dict[str, str]) -> None:
    def prompt_tokens(url: str) -> float:
        return metric(url, "pagedserve_prompt_tokens_total")
    dedicated_before = prompt_tokens(engines["dedicated"])
    shared_before = prompt_tokens(engines["shared"])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-free", max_retries=0)
    # Free's budget is ~0: while the shared pool still drains an earlier test's streams (as the
    # gateway's last /load poll sees it), free is shed; only the first request may meet that stale
    # view. It must never spill into 'dedicated'.
    deadline = time.monotonic() + 20
    while True:
        try:
            client.completions.create(model=MODEL, prompt="free request 0", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "free traffic was still shed 20 s after the pool drained"
            time.sleep(0.2)
    for i in range(1, 6):  # one at a time into an idle pool: none may be shed
        client.completions.create(model=MODEL, prompt=f"free request {i}", max_tokens=2)
    assert prompt_tokens(engines["dedicated"]) == dedicated_before
    assert prompt_tokens(engines["shared"]) > shared_before
    paid = httpx.post(f"{gateway.url}/v1/completions", headers={"Authorization": "Bearer sk-paid"},
                      json={"model": MODEL, "prompt": "paid goes first to its own pool", "max_tokens": 2})
    assert paid.status_code == 200 and paid.headers["x-pagedserve-pool"] == "dedicated"
    assert prompt_tokens(engines["dedicated"]) > dedicated_before
    # The dead replica in the shared pool was routed around and is reported down.
    assert httpx.get(f"{gateway.url}/health").json()["pools"]["shared"] == {"healthy": 1, "replicas": 2}


def test_redis_backed_gateway_reconciles_exactly(engines: dict[str, str], redis_server: Any) -> None:
    """The same reserve-then-reconcile through Redis: the bucket ends exactly usage lower."""
    config = _config(engines)
    config.redis_url = redis_server.url
    with GatewayThread(config) as gw:
        assert isinstance(gw.gateway.limiter, RedisLimiter)
        before = bucket_levels(gw, "sk-meter")[0]
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-meter", max_retries=0)
        chunks = list(client.completions.create(model=MODEL, prompt="through redis", max_tokens=7, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 7
        wait_until(lambda: abs(before - bucket_levels(gw, "sk-meter")[0] - usage.total_tokens) < 0.05, timeout=5,
                   what="the stream reconciled through Redis")
        assert metric(gw.url, "pagedserve_gateway_limiter_up") == 1


def test_redis_down_policy_at_the_http_edge(engines: dict[str, str]) -> None:
    """Nothing listens at the Redis URL: a fail-closed tier gets 503 at once, a fail-open tier is
    served unmetered; neither waits longer than the Redis timeout."""
    config = _config(engines)
    config.redis_url = f"redis://127.0.0.1:{free_port()}/0"
    config.redis_timeout_s = 0.1
    config.tiers["paid"].on_limiter_error = "open"
    with GatewayThread(config) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        for _ in range(5):  # before and after the circuit breaker opens
            start = time.monotonic()
            closed = c.post("/v1/completions", headers={"Authorization": "Bearer sk-meter"},
                            json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert time.monotonic() - start < 1.0
            assert closed.status_code == 503 and closed.json()["error"]["code"] == "rate_limiter_unavailable"
            assert int(closed.headers["Retry-After"]) >= 1
            opened = c.post("/v1/completions", headers={"Authorization": "Bearer sk-paid"},
                            json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert opened.status_code == 200
        assert metric(gw.url, "pagedserve_gateway_limiter_fail_open_total", tier="paid") == 5
        assert metric(gw.url, "pagedserve_gateway_limiter_up") == 0
        assert metric(gw.url, "pagedserve_gateway_limiter_errors_total") >= 3
