"""Replicas that fail under the gateway: a stream that breaks off is never a clean end for the
client (an error event, then ``[DONE]``), a broken plain response is a 502 with OpenAI's body, a
slow ``/tokenize`` cannot stretch a request's wait past its tier's budget, and a replica whose
engine is dead (503 on ``/load`` or ``/health``, or on a forward) gets no traffic. Charges as
GATEWAY.md says: a request the replica took pays its prompt, plus a token per chunk streamed."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedserve.bench.processes import running_process
from pagedserve.gateway.config import GatewayConfig, parse_config
from tests.gateway.conftest import MODEL
from tests.gateway.gateway_server import GatewayThread, bucket_levels, metric
from tests.gateway.stub_replica import StubReplica
from tests.helpers.servers import free_port

PROMPT = [5, 6, 7]  # token ids: counted exactly, without a /tokenize call


def _config(url: str, *, poll_s: float = 60.0, budget_s: float = 5.0, seats: int | None = None,
            load_source: str = "auto", extra_pool: str = "", tier_extra: str = "") -> GatewayConfig:
    """One pool of ``url`` (plus ``extra_pool`` replicas); a bucket that does not refill (0.001/s), so
    its level says exactly what each request was charged. ``tier_extra``: more lines of the tier."""
    replicas = ", ".join(f'"{u}"' for u in [url, *filter(None, [extra_pool])])
    return parse_config(f"""
[gateway]
load_poll_interval_s = {poll_s}

[pools.p]
replicas = [{replicas}]
load_source = "{load_source}"
{f"seats = {seats}" if seats else ""}

[tiers.t]
token_rate = 0.001
token_burst = 100000
request_rate = 0.001
request_burst = 100
pools = ["p"]
max_queue_wait_s = {budget_s}
{tier_extra}

[keys]
"sk-t" = "t"
""")


AUTH = {"Authorization": "Bearer sk-t"}


def _stream_lines(gw: GatewayThread, body: dict[str, Any]) -> list[str]:
    """Every non-blank line of a streamed completion through ``gw``."""
    with httpx.Client(base_url=gw.url, headers=AUTH, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **body}) as r:
            assert r.status_code == 200, r.read()
            return [line for line in r.iter_lines() if line]


def _wait_until(check: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("end", ["crash", "eof"])
@pytest.mark.parametrize("events", [0, 3])
def test_a_stream_broken_off_ends_with_an_error_event_then_done(end: str, events: int) -> None:
    """The replica dies mid-stream (the connection drops) or closes the body before [DONE]: the
    client gets the chunks that came, an OpenAI error event, then [DONE]; it pays the prompt plus a
    token per chunk, and its request slot stays spent (the replica took the request)."""
    with StubReplica(status=200, stream_events=events, stream_end=end) as stub, GatewayThread(_config(stub.url)) as gw:
        tokens_before, requests_before = bucket_levels(gw, "sk-t")
        lines = _stream_lines(gw, {"prompt": PROMPT, "max_tokens": 50})
        assert [json.loads(x[6:])["choices"][0]["text"] for x in lines[:events]] == [f" t{i}" for i in range(events)]
        assert len(lines) == events + 2 and lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("server_error", "replica_error")
        assert "incomplete" in error["message"]
        tokens_after, requests_after = bucket_levels(gw, "sk-t")
        assert tokens_before - tokens_after == pytest.approx(len(PROMPT) + events, abs=0.05)
        assert requests_before - requests_after == pytest.approx(1, abs=0.01)
        assert metric(gw.url, "pagedserve_gateway_reconciled_total", tier="t", outcome="failed") == 1
        # A dropped connection takes the replica out of routing (the next poll would bring it back).
        assert gw.gateway.pools["p"].replicas[0].healthy is (end == "eof")
        assert stub.completions == 1


def test_the_openai_client_raises_on_a_broken_stream() -> None:
    with StubReplica(status=200, stream_events=2, stream_end="crash") as stub, \
            GatewayThread(_config(stub.url)) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-t", max_retries=0)
        texts = []
        with pytest.raises(openai.APIError, match="incomplete"):
            for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=50, stream=True):
                texts.append(chunk.choices[0].text)
        assert texts == [" t0", " t1"]


@pytest.mark.parametrize("end, usage_seen", [("done", True), ("error", False), ("usage_crash", True)])
def test_what_the_replica_ended_itself_is_not_doubled(end: str, usage_seen: bool) -> None:
    """A clean stream passes unchanged; the replica's own error event is not followed by a second
    one; a stream that broke after its usage chunk had finished generating: it only lacks [DONE]."""
    with StubReplica(status=200, stream_events=2, stream_end=end) as stub, GatewayThread(_config(stub.url)) as gw:
        tokens_before = bucket_levels(gw, "sk-t")[0]
        lines = _stream_lines(gw, {"prompt": PROMPT, "max_tokens": 50, "stream_options": {"include_usage": True}})
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
        errors = [x for x in lines if '"error"' in x]
        assert len(errors) == (end == "error")
        if errors:
            assert json.loads(errors[0][6:])["error"]["code"] == "internal_error"  # the replica's, as it sent it
        used = tokens_before - bucket_levels(gw, "sk-t")[0]
        # The stub's usage (3 prompt tokens + 3), or without it the prompt + a token per chunk.
        assert used == pytest.approx(len(PROMPT) + 3 if usage_seen else len(PROMPT) + 2, abs=0.05)
        outcome = "usage" if usage_seen else "failed"
        assert metric(gw.url, "pagedserve_gateway_reconciled_total", tier="t", outcome=outcome) == 1


def test_a_plain_response_broken_off_is_a_502_with_an_openai_body() -> None:
    with StubReplica(status=200) as stub, GatewayThread(_config(stub.url)) as gw, \
            httpx.Client(base_url=gw.url, headers=AUTH, timeout=10) as c:
        stub.plain_crash = True
        tokens_before, requests_before = bucket_levels(gw, "sk-t")
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 50})
        assert r.status_code == 502 and int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("server_error", "replica_error")
        tokens_after, requests_after = bucket_levels(gw, "sk-t")
        assert tokens_before - tokens_after == pytest.approx(len(PROMPT), abs=0.05)  # the prompt, not 53
        assert requests_before - requests_after == pytest.approx(1, abs=0.01)
        assert not gw.gateway.pools["p"].replicas[0].healthy


def test_an_engine_killed_mid_stream(tiny_model_dir: Path) -> None:
    """The real thing: a `pagedserve serve` replica SIGKILLed while it streams through the gateway.
    The openai client raises instead of seeing a clean end; the replica leaves routing."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL, "--log-level", "warning"]
    with running_process(cmd, f"{url}/health", timeout_s=120) as proc, GatewayThread(_config(url)) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-t", max_retries=0, timeout=20)
        tokens_before = bucket_levels(gw, "sk-t")[0]
        chunks = 0
        start = time.monotonic()
        with pytest.raises(openai.APIError, match="incomplete"):
            for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, stream=True,
                                               extra_body={"ignore_eos": True}):
                chunks += 1
                if chunks == 4:
                    proc.kill()
        assert 4 <= chunks < 3000 and time.monotonic() - start < 20
        assert proc.wait(timeout=10) != 0
        used = tokens_before - bucket_levels(gw, "sk-t")[0]
        assert used == pytest.approx(len(PROMPT) + chunks, abs=0.05)  # the prompt and the chunks it sent
        assert not gw.gateway.pools["p"].replicas[0].healthy
        r = httpx.post(f"{gw.url}/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": PROMPT})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available"


def _post_timed(gw: GatewayThread, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(f"{gw.url}/v1/completions", headers=AUTH, json={"model": MODEL, **body}, timeout=20)
    return r, time.monotonic() - start


def test_a_slow_tokenize_is_cut_at_the_tier_budget() -> None:
    """/tokenize takes 3 s; the tier's budget is 0.6 s. With a seat free the request goes at once
    when the budget runs out, its reservation counted by the byte bound; with no seat free it is
    shed 429 overloaded at the budget, and its tokens and request slot come back. Either way it
    waited no longer than its budget before reaching (or not) a replica."""
    with StubReplica(status=200, tokenize_delay_s=3.0) as stub, \
            GatewayThread(_config(stub.url, budget_s=0.6, seats=1)) as gw:
        r, elapsed = _post_timed(gw, {"prompt": "three words here", "max_tokens": 5})
        assert r.status_code == 200 and stub.tokenize_calls == 1 and stub.completions == 1
        assert 0.5 < elapsed < 1.5, elapsed

        stub.delay_s = 3.0  # the next request holds the only seat (token ids: no /tokenize call)
        holder = threading.Thread(target=_post_timed, args=(gw, {"prompt": PROMPT, "max_tokens": 5}))
        holder.start()
        _wait_until(lambda: stub.completions == 2, "the seat is taken")
        tokens_before, requests_before = bucket_levels(gw, "sk-t")
        r, elapsed = _post_timed(gw, {"prompt": "three words here", "max_tokens": 5})
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["Retry-After"]) >= 1
        assert 0.5 < elapsed < 1.5, elapsed
        assert stub.tokenize_calls == 2 and stub.completions == 2  # never forwarded
        assert bucket_levels(gw, "sk-t") == (pytest.approx(tokens_before, abs=0.05),
                                             pytest.approx(requests_before, abs=0.01))
        assert metric(gw.url, "pagedserve_gateway_shed_total", tier="t", reason="queue_timeout") == 1
        holder.join(timeout=10)


def test_tokenize_within_the_budget_counts_exactly_and_a_long_budget_is_still_capped() -> None:
    """A /tokenize answered within the budget is used (3 words → 3 tokens reserved, then the usage);
    with a budget longer than the 2 s cap, a slower one is abandoned at 2 s for the byte bound."""
    with StubReplica(status=200, tokenize_delay_s=0.2) as stub, GatewayThread(_config(stub.url, budget_s=1.0)) as gw:
        r, elapsed = _post_timed(gw, {"prompt": "three words here", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3 and elapsed < 1.0
        stub.tokenize_delay_s = 3.0
        gw.gateway.config.tiers["t"].max_queue_wait_s = 10.0
        r, elapsed = _post_timed(gw, {"prompt": "three words here", "max_tokens": 5})
        assert r.status_code == 200 and 1.9 < elapsed < 2.9, elapsed


@pytest.mark.parametrize("endpoint, load_source", [("load", "auto"), ("load", "pagedserve"), ("health", "none")])
def test_a_replica_whose_engine_died_gets_no_traffic(endpoint: str, load_source: str) -> None:
    """Its /load (or, for a health-only pool, /health) answers 503: the next poll takes it out of
    routing and every request goes to the other replica; when it answers 200 again it is back."""
    with StubReplica(status=200) as dead, StubReplica(status=200) as alive, \
            GatewayThread(_config(dead.url, poll_s=0.05, load_source=load_source, extra_pool=alive.url)) as gw:
        replica = gw.gateway.pools["p"].replicas[0]
        assert replica.healthy
        setattr(dead, f"{endpoint}_status", 503)
        _wait_until(lambda: not replica.healthy, "the dead replica is out of routing")
        for _ in range(6):
            r, _ = _post_timed(gw, {"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200
        assert (dead.completions, alive.completions) == (0, 6)
        assert "503" in replica.last_error
        setattr(dead, f"{endpoint}_status", 200)
        _wait_until(lambda: replica.healthy, "the replica is back in routing")


def test_a_replica_too_busy_to_answer_one_poll_stays_in_routing() -> None:
    """A /load unanswered within the poll's timeout (0.5 s here) is load as often as death: the replica
    keeps its traffic until three polls in a row went unanswered, and is back at the next answer;
    a 503 after that takes it out at once."""
    with StubReplica(status=200) as stub, GatewayThread(_config(stub.url, poll_s=0.05)) as gw:
        replica = gw.gateway.pools["p"].replicas[0]
        _wait_until(lambda: replica.healthy, "the replica is in routing")
        stub.load_delay_s = 5.0
        stalled = time.monotonic()
        _wait_until(lambda: replica.poll_timeouts >= 1, "a poll timed out")
        assert replica.healthy
        r, _ = _post_timed(gw, {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and stub.completions == 1
        _wait_until(lambda: not replica.healthy, "three unanswered polls take the replica out")
        assert time.monotonic() - stalled > 1.0  # two whole 0.5 s timeouts at least, after the stall began
        assert replica.last_error.startswith("3 polls in a row unanswered"), replica.last_error
        stub.load_delay_s = 0.0
        _wait_until(lambda: replica.healthy and replica.poll_timeouts == 0, "the replica is back in routing")
        stub.load_status = 503
        _wait_until(lambda: not replica.healthy, "a 503 takes it out", timeout=2.0)
        assert "503" in replica.last_error


def test_a_replica_dead_from_the_start_is_never_routed() -> None:
    with StubReplica(status=200) as dead:
        dead.load_status = 503
        with GatewayThread(_config(dead.url)) as gw:
            assert not gw.gateway.pools["p"].replicas[0].healthy
            r, _ = _post_timed(gw, {"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available"
            assert dead.completions == 0


def test_a_forward_answered_engine_unavailable_takes_the_replica_out_at_once() -> None:
    """Between two polls (here 60 s apart) a 503 engine_unavailable from a forward is enough; a 503
    of another kind (a full queue is load, not death) leaves the replica in routing."""
    with StubReplica(status=503) as stub, GatewayThread(_config(stub.url)) as gw:
        replica = gw.gateway.pools["p"].replicas[0]
        r, _ = _post_timed(gw, {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and replica.healthy  # the stub's 503 has no code
        stub.completions = 0
        stub.error_code = "engine_unavailable"
        r, _ = _post_timed(gw, {"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert not replica.healthy
        r, _ = _post_timed(gw, {"prompt": PROMPT, "max_tokens": 2})
        assert r.json()["error"]["code"] == "no_replica_available" and stub.completions == 1
