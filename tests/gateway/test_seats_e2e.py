"""The gateway's seat queue in front of a real engine: requests wait in the gateway (never in the
engine), paid skips the queue, a queued request is shed at its budget with its tokens and request
slot refunded; the request slot is also refunded when a replica fails before doing any work; and
vLLM's gauges on /metrics stand in for /load."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedserve.gateway.config import parse_config
from tests.gateway.conftest import ENGINE_SEATS, MODEL
from tests.gateway.gateway_server import GatewayThread, bucket_levels, metric
from tests.gateway.stub_replica import StubReplica
from tests.helpers.servers import run_paced_engine_server, wait_for_idle

# 4,000 of the tiny model's 4,096 positions, on an engine whose steps take 3 ms longer than the
# tiny model's (tests/helpers/faults.py's Paced): the stream must outlast the whole test on any CPU
# (unpaced, a Zen 5 generated all 4,000 in 2.3 s and the queued request went early).
LONG = {"model": MODEL, "prompt": "hold a seat", "max_tokens": 4000, "ignore_eos": True, "stream": True}
STEP_S = 0.003


@pytest.fixture(scope="module")
def paced(tiny_model_dir: Path) -> Iterator[str]:
    """The URL of a real `pagedserve serve` of the tiny model whose core paces its steps."""
    with run_paced_engine_server(tiny_model_dir, STEP_S, "--served-model-name", MODEL, "--max-num-seqs",
                                 str(ENGINE_SEATS), "--log-level", "warning") as url:
        yield url


@pytest.fixture(autouse=True)
def _no_leaked_kv_blocks_when_paced(request: pytest.FixtureRequest) -> Iterator[None]:
    """As conftest's check for the shared engines: a test that used the paced engine leaves it idle
    with 0 KV blocks used."""
    yield
    if "paced" in request.fixturenames:
        load = wait_for_idle(request.getfixturevalue("paced"), timeout=15.0)
        assert load["kv_blocks_used"] == 0 and load["running"] == 0 and load["waiting"] == 0, load


def _wait_until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        out["response"] = fn()
        out["elapsed"] = time.monotonic() - start
    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_requests_queue_in_the_gateway_and_are_shed_at_their_budget(paced: str) -> None:
    config = parse_config(f"""
[gateway]
load_poll_interval_s = 0.1
default_service_s = 0.5

[pools.q]
replicas = ["{paced}"]
seats = 2             # fewer than the engine's ENGINE_SEATS (4): the gateway gates at 2
reserved_seats = 1    # one of them kept for paid

[tiers.paid]
token_rate = 1000
token_burst = 100000
pools = ["q"]
priority = 0
max_queue_wait_s = 1.0

[tiers.free]
token_rate = 0.001
token_burst = 100000
request_rate = 0.001
request_burst = 10
pools = ["q"]
priority = 10
max_queue_wait_s = 3.0   # room for paid's request to finish while free still waits
bucket = "tier"

[keys]
"sk-q-paid" = "paid"
"sk-q-free" = "free"
""")
    free, paid = {"Authorization": "Bearer sk-q-free"}, {"Authorization": "Bearer sk-q-paid"}
    short = {"model": MODEL, "prompt": "short", "max_tokens": 4, "ignore_eos": True}
    with GatewayThread(config) as gw, httpx.Client(base_url=gw.url, timeout=30) as c, contextlib.ExitStack() as stack:
        replica = gw.gateway.pools["q"].replicas[0]
        assert replica.source == "pagedserve"  # auto-detected: /load answered
        held = stack.enter_context(c.stream("POST", "/v1/completions", json=LONG, headers=free))
        assert held.status_code == 200 and held.headers["x-pagedserve-queue-wait-ms"] == "0"
        lines = held.iter_lines()  # kept: a dropped iterator would close the stream
        next(lines)  # it is running
        tokens_before, requests_before = bucket_levels(gw, "sk-q-free")

        # Free's only seat is taken: the next free request waits in the gateway, not in the engine.
        shed_thread, shed = _in_thread(lambda: c.post("/v1/completions", json=short, headers=free))
        _wait_until(lambda: gw.gateway.dispatcher.queued("q") == {"free": 1}, "the free request is queued")
        load = httpx.get(f"{paced}/load").json()
        assert (load["running"], load["waiting"]) == (1, 0)
        assert metric(gw.url, "pagedserve_gateway_queued", tier="free", pool="q") == 1
        # Paid has a reserved seat: straight in, while free still waits.
        p = c.post("/v1/completions", json=short, headers=paid)
        assert p.status_code == 200 and p.headers["x-pagedserve-queue-wait-ms"] == "0"
        assert shed_thread.is_alive()

        # Nobody frees free's seat within its 3 s budget: 429 overloaded, nothing reached the engine.
        shed_thread.join(timeout=10)
        r = shed["response"]
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        assert "budget" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1
        assert 1.5 < shed["elapsed"] < 4.5 and int(r.headers["x-pagedserve-queue-wait-ms"]) >= 1500
        assert r.headers["x-ratelimit-limit-tokens"] == "100000"
        # Its reservation came back exactly once: tokens (refill is 0.001/s) and the request slot.
        tokens_after, requests_after = bucket_levels(gw, "sk-q-free")
        assert tokens_after == pytest.approx(tokens_before, abs=0.05)
        assert requests_after == pytest.approx(requests_before, abs=0.01)
        assert metric(gw.url, "pagedserve_gateway_shed_total", tier="free", reason="queue_timeout") == 1
        assert metric(gw.url, "pagedserve_gateway_reconciled_total", tier="free", outcome="shed") == 1

        # A client that gives up while queued leaves the queue, and its reservation comes back.
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=short, headers=free, timeout=0.3)
        _wait_until(lambda: not gw.gateway.dispatcher.queued("q"), "the abandoned request left the queue", 3)
        _wait_until(lambda: metric(gw.url, "pagedserve_gateway_reconciled_total", tier="free", outcome="shed") == 2,
                    "the abandoned request was settled", 3)
        assert bucket_levels(gw, "sk-q-free")[1] == pytest.approx(requests_before, abs=0.01)

        # A queued request goes as soon as the seat frees up.
        waiting_thread, waiting = _in_thread(lambda: c.post("/v1/completions", json=short, headers=free))
        _wait_until(lambda: gw.gateway.dispatcher.queued("q") == {"free": 1}, "the next free request is queued")
        time.sleep(0.2)  # not a wait for anything: the queue time the header must report below (>= 150 ms)
        stack.close()  # the long stream's client leaves: its seat frees
        waiting_thread.join(timeout=10)
        r = waiting["response"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert int(r.headers["x-pagedserve-queue-wait-ms"]) >= 150
        assert waiting["elapsed"] < 1.5
        assert not gw.gateway.dispatcher.queued("q") and replica.inflight_total == 0


def test_request_slot_refunded_when_the_replica_fails_before_any_work() -> None:
    with StubReplica(status=503) as stub:
        config = parse_config(f"""
[gateway]
load_poll_interval_s = 60   # the replica stays 'up' after the stub stops, until a forward fails

[pools.stub]
replicas = ["{stub.url}"]

[tiers.t]
token_rate = 1000
token_burst = 100000
request_rate = 0.001
request_burst = 2
pools = ["stub"]

[keys]
"sk-stub" = "t"
""")
        auth = {"Authorization": "Bearer sk-stub"}
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        with GatewayThread(config) as gw, httpx.Client(base_url=gw.url, headers=auth, timeout=10) as c:
            # Three requests through a bucket of two: each 503 gives its slot back, so none is 429.
            for _ in range(3):
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 503 and r.json()["error"]["message"] == "stub answers 503"
            assert stub.completions == 3
            assert bucket_levels(gw, "sk-stub")[1] == pytest.approx(2, abs=0.01)
            # A 4xx is the request's own fault: the replica looked at it, and the slot stays spent.
            assert c.post("/v1/completions", json={**body, "prompt": "bad"}).status_code == 400
            assert bucket_levels(gw, "sk-stub")[1] == pytest.approx(1, abs=0.01)
            stub.stop()  # unreachable now, though the last poll said it was up
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 502 and r.json()["error"]["code"] == "replica_unreachable"
            assert bucket_levels(gw, "sk-stub")[1] == pytest.approx(1, abs=0.01)
            assert metric(gw.url, "pagedserve_gateway_reconciled_total", tier="t", outcome="failed") == 5


def test_request_slot_stays_spent_when_the_replica_took_the_request_and_never_answered() -> None:
    """Sent, then a read timeout: the replica may have worked on it, so unlike an unreachable
    replica the request slot is not given back and the prompt is charged."""
    with StubReplica(status=200, delay_s=3.0) as stub:
        config = parse_config(f"""
[gateway]
request_timeout_s = 0.5

[pools.slow]
replicas = ["{stub.url}"]

[tiers.t]
token_rate = 0.001
token_burst = 1000
request_rate = 0.001
request_burst = 2
pools = ["slow"]

[keys]
"sk-slow" = "t"
""")
        with GatewayThread(config) as gw, httpx.Client(base_url=gw.url, timeout=10,
                                                       headers={"Authorization": "Bearer sk-slow"}) as c:
            tokens_before, requests_before = bucket_levels(gw, "sk-slow")
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})
            assert r.status_code == 502 and r.json()["error"]["code"] == "replica_error"
            assert stub.completions == 1
            tokens_after, requests_after = bucket_levels(gw, "sk-slow")
            assert requests_after == pytest.approx(requests_before - 1, abs=0.01)
            assert tokens_before - tokens_after == pytest.approx(3, abs=0.05)  # the prompt, not the reservation
            assert metric(gw.url, "pagedserve_gateway_reconciled_total", tier="t", outcome="failed") == 1

def test_vllm_gauges_on_metrics_stand_in_for_load(paced: str) -> None:
    """A pagedserve engine read as if it were vLLM (/load unused): requests another client holds
    there fill its seats, which only the gauges can tell the gateway."""
    with StubReplica(vllm=True, running=3, waiting=1) as stub:
        config = parse_config(f"""
[gateway]
load_poll_interval_s = 0.1
default_service_s = 5.0

[pools.v]
replicas = ["{paced}"]
load_source = "vllm"
seats = 2

[pools.auto]
replicas = ["{stub.url}"]   # no /load: auto-detected as vLLM
seats = 8

[tiers.free]
token_rate = 1000
token_burst = 100000
pools = ["v"]
priority = 10
max_queue_wait_s = 0.5

[keys]
"sk-v" = "free"
""")
        with GatewayThread(config) as gw, httpx.Client(timeout=30) as c, contextlib.ExitStack() as stack:
            replica, stubbed = gw.gateway.pools["v"].replicas[0], gw.gateway.pools["auto"].replicas[0]
            assert replica.source == "vllm" and replica.seats == 2
            assert stubbed.source == "vllm" and stubbed.load is not None
            assert (stubbed.load.running, stubbed.load.waiting, stubbed.seats) == (3, 1, 8)
            streams = []  # kept: a dropped line iterator would close its stream
            for _ in range(2):  # another client fills both seats, bypassing the gateway
                held = stack.enter_context(c.stream("POST", f"{paced}/v1/completions", json=LONG))
                streams.append(held.iter_lines())
                next(streams[-1])
            _wait_until(lambda: replica.load is not None and replica.load.running == 2, "the gauges show 2 running")
            r = c.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer sk-v"},
                       json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
            stack.close()
            _wait_until(lambda: replica.load is not None and replica.load.running == 0, "the gauges show 0 running")
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-v", max_retries=0)
            done = client.completions.create(model=MODEL, prompt="through vLLM's gauges", max_tokens=3,
                                             extra_body={"ignore_eos": True})
            assert done.usage is not None and done.usage.completion_tokens == 3
