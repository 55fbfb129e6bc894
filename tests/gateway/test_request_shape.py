"""The gateway counts what the replica will really run: several prompts per completions request,
``best_of`` > ``n`` (seats and the token reservation), ``max_tokens: 0`` exactly where the replica
takes it (completions with echo), a request that no replica could seat refused with 400 rather than
left at the head of the queue; and ``/tokenize``, ``/detokenize``, ``/version`` passed through
with the key checked. Against the stub replica (4 seats) and a real ``tiny`` engine."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pagedserve.gateway.config import GatewayConfig, parse_config
from pagedserve.gateway.shape import Shape, read_shape
from tests.gateway.conftest import MODEL
from tests.gateway.gateway_server import GatewayThread, bucket_levels, metric
from tests.gateway.stub_replica import StubReplica
from tests.helpers.waiting import wait_until

AUTH = {"Authorization": "Bearer sk-s"}


def _config(url: str) -> GatewayConfig:
    """One pool of ``url``; a bucket that does not refill (0.001/s), so its level says what was charged."""
    return parse_config(f"""
[gateway]
load_poll_interval_s = 0.2

[pools.p]
replicas = ["{url}"]

[tiers.s]
token_rate = 0.001
token_burst = 100000
pools = ["p"]
max_queue_wait_s = 5.0

[keys]
"sk-s" = "s"
""")


def test_read_shape() -> None:
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    assert read_shape({"prompt": "x", "max_tokens": 5}, cmpl, 9) == Shape(cap=5, prompts=1, per_prompt=1, n=1)
    s = read_shape({"prompt": ["a", "b", "c"], "n": 2, "best_of": 3, "max_tokens": 4}, cmpl, 9)
    assert isinstance(s, Shape) and (s.seats, s.output_tokens, s.seats_param) == (9, 36, "prompt")
    assert read_shape({"prompt": [[1, 2], [3]], "n": 2}, cmpl, 9) == Shape(cap=9, prompts=2, per_prompt=2, n=2)
    assert read_shape({"prompt": [1, 2, 3]}, cmpl, 9) == Shape(cap=9, prompts=1, per_prompt=1, n=1)  # one id list
    assert read_shape({"prompt": "x", "best_of": 4}, cmpl, 9).seats_param == "best_of"  # type: ignore[union-attr]
    # max_tokens 0: completions with echo true only, as the replica decides.
    assert read_shape({"prompt": "x", "max_tokens": 0, "echo": True}, cmpl, 9) == Shape(0, 1, 1, 1)
    for body, path in (({"prompt": "x", "max_tokens": 0}, cmpl), ({"prompt": "x", "max_tokens": 0, "echo": 1}, cmpl),
                       ({"messages": [], "max_tokens": 0, "echo": True}, chat),
                       ({"prompt": "x", "max_completion_tokens": 0, "echo": True}, cmpl)):
        assert isinstance(read_shape(body, path, 9), str), body
    # Chat has neither several prompts nor best_of: the replica refuses the field, nothing to reserve for it.
    assert read_shape({"messages": [], "best_of": 5, "n": 2}, chat, 9) == Shape(9, 1, 2, 2)
    for bad in ({"best_of": "2"}, {"best_of": 0}, {"n": True}, {"n": 0}):
        assert isinstance(read_shape({"prompt": "x", **bad}, cmpl, 9), str), bad


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[StubReplica, GatewayThread]]:
    with StubReplica(status=200, tokenize_delay_s=0.0) as replica, GatewayThread(_config(replica.url)) as gw:
        yield replica, gw


def _reserved(gw: GatewayThread) -> float:
    return metric(gw.url, "pagedserve_gateway_tokens_reserved_total", tier="s")


def test_seats_and_tokens_counted_from_prompts_and_best_of(stub: tuple[StubReplica, GatewayThread]) -> None:
    replica, gw = stub
    with httpx.Client(base_url=gw.url, headers=AUTH, timeout=30) as c:
        # Two text prompts (2 and 3 words: the stub's token count, one /tokenize call each), best_of 2.
        before, calls = _reserved(gw), replica.tokenize_calls
        r = c.post("/v1/completions", json={"prompt": ["one two", "three four five"], "best_of": 2, "max_tokens": 5})
        assert r.status_code == 200
        assert replica.tokenize_calls - calls == 2
        assert _reserved(gw) - before == 2 + 3 + 2 * 2 * 5
        # Token-id prompts are counted without asking; 2 prompts x n 2 = the stub's 4 seats.
        before = _reserved(gw)
        assert c.post("/v1/completions", json={"prompt": [[1, 2], [3, 4, 5]], "n": 2, "max_tokens": 3}).status_code == 200
        assert _reserved(gw) - before == 5 + 4 * 3
        # More sequences than the replica has seats: refused at once (it would never get a seat), never forwarded.
        sent = replica.completions
        for body, param in (({"prompt": ["a", "b", "c"], "n": 2}, "prompt"), ({"prompt": "a", "best_of": 5}, "best_of"),
                            ({"prompt": "a", "n": 5}, "n")):
            start = time.monotonic()
            r = c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert time.monotonic() - start < 2.0
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "sequences_exceed_seats" and err["param"] == param, err
            assert "at most 4 seats" in err["message"] and "can never pass" in err["message"]
        assert replica.completions == sent
        assert metric(gw.url, "pagedserve_gateway_shed_total", tier="s", reason="too_many_seats") == 3
        # The queue was not held up: a request that fits still goes straight through.
        assert c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200


def test_max_tokens_zero_only_with_echo(stub: tuple[StubReplica, GatewayThread]) -> None:
    replica, gw = stub
    with httpx.Client(base_url=gw.url, headers=AUTH, timeout=30) as c:
        before = _reserved(gw)
        r = c.post("/v1/completions", json={"prompt": "score these words", "max_tokens": 0, "echo": True})
        assert r.status_code == 200 and replica.last_body is not None and replica.last_body["max_tokens"] == 0
        assert _reserved(gw) - before == 3  # the prompt only: nothing is generated
        sent = replica.completions
        for body, path in (({"prompt": "x", "max_tokens": 0}, "/v1/completions"),
                           ({"prompt": "x", "max_tokens": 0, "echo": "true"}, "/v1/completions"),
                           ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "/v1/chat/completions")):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
            assert "max_tokens" in r.json()["error"]["message"]
        assert replica.completions == sent


def test_tokenize_detokenize_version_passed_through(stub: tuple[StubReplica, GatewayThread]) -> None:
    _, gw = stub
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for method, path, body in (("POST", "/tokenize", {"prompt": "a b"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/version", None)):
            r = c.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert c.post("/tokenize", json={"prompt": "a b c"}, headers=AUTH).json()["count"] == 3
        assert c.post("/detokenize", json={"tokens": [1, 2]}, headers=AUTH).json() == {"prompt": "w1 w2"}
        bad = c.post("/detokenize", json={"tokens": [100]}, headers=AUTH)  # the replica's 400, unchanged
        assert bad.status_code == 400 and "[0, 100)" in bad.json()["error"]["message"]
        assert c.get("/version", headers=AUTH).json() == {"version": "stub-1"}


def test_passthrough_without_a_replica_is_503() -> None:
    with GatewayThread(_config("http://127.0.0.1:9")) as gw, httpx.Client(base_url=gw.url, timeout=10) as c:
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/v1/models")):
            r = c.request(method, path, json={"prompt": "x"} if method == "POST" else None, headers=AUTH)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica_available", path
            assert r.headers["Retry-After"] == "1"


def test_several_prompts_and_best_of_through_a_real_engine(engines: dict[str, str]) -> None:
    """The tiny engine runs 2 prompts x best_of 2: the reservation is exactly its usage (prompts
    counted by /tokenize, every sampled token charged) and the bucket ends exactly usage lower; echo
    with max_tokens 0 is served; /detokenize and /version come from the replica."""
    with GatewayThread(_config(engines["dedicated"])) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sk-s", max_retries=0)
        bucket, reserved = bucket_levels(gw, "sk-s")[0], _reserved(gw)
        r = client.completions.create(model=MODEL, prompt=["The cat sat", "A dog"], n=1, best_of=2, max_tokens=4,
                                      extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage is not None and r.usage.completion_tokens == 2 * 2 * 4
        assert _reserved(gw) - reserved == r.usage.total_tokens
        echo = client.completions.create(model=MODEL, prompt="only the prompt", max_tokens=0, echo=True)
        assert echo.choices[0].text == "only the prompt" and echo.usage is not None
        assert echo.usage.completion_tokens == 0
        used = r.usage.total_tokens + echo.usage.total_tokens
        wait_until(lambda: abs(bucket - bucket_levels(gw, "sk-s")[0] - used) < 0.05, timeout=5,
                   what="both requests reconciled")
        with httpx.Client(base_url=gw.url, headers=AUTH, timeout=30) as c:
            ids = c.post("/tokenize", json={"prompt": "The cat sat"}).json()["tokens"]
            assert c.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("The cat sat")
            assert c.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
            assert c.get("/version").json()["version"] == httpx.get(f"{engines['dedicated']}/version").json()["version"]
