"""The Responses API's store shared through Redis: two gateway processes, two real tiny replicas,
one real Redis. Gateway A routes only to replica one and gateway B only to replica two, so a
conversation whose turns alternate between the gateways alternates between the replicas too; each
turn's prompt is the whole conversation (the store expanded it, the replica is stateless). Another
key gets 404 for those ids; the store outlives a gateway restart; an expired id is 404."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedserve.bench.processes import running_process
from tests.gateway.conftest import MODEL
from tests.gateway.gateway_server import metric
from tests.helpers.servers import free_port

KEY, OTHER_KEY = "sk-alice", "sk-bob"


def _config(replica: str) -> str:
    return f"""
[gateway]
load_poll_interval_s = 0.1
redis_timeout_s = 5.0

[pools.only]
replicas = ["{replica}"]

[tiers.t]
token_rate = 100000
token_burst = 1000000
pools = ["only"]
max_queue_wait_s = 30.0

[keys]
"{KEY}" = "t"
"{OTHER_KEY}" = "t"
"""


@contextlib.contextmanager
def _gateway(config: Path, redis_url: str, *extra: str, port: int | None = None) -> Iterator[str]:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "--log-level", "WARNING", "gateway", "--config", str(config),
           "--response-store", redis_url, "--port", str(port), *extra]
    with running_process(cmd, f"{url}/health", timeout_s=60):
        yield url


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory, engines: dict[str, str]) -> list[Path]:
    out = []
    for name in ("dedicated", "shared"):
        path = Path(tmp_path_factory.mktemp("gw")) / f"{name}.toml"
        path.write_text(_config(engines[name]))
        out.append(path)
    return out


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _tokens(replica: str, messages: list[dict[str, str]]) -> int:
    return httpx.post(f"{replica}/tokenize", json={"messages": messages}, timeout=30).json()["count"]


def _prompt_tokens(replica: str) -> float:
    return metric(replica, "pagedserve_prompt_tokens_total")


def _wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    """The replicas' metrics come from their latest stats snapshot: wait (bounded) for it to show."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        time.sleep(0.05)


def test_conversation_across_gateways_replicas_and_a_restart(configs: list[Path], engines: dict[str, str],
                                                             redis_server: Any) -> None:
    replicas = [engines["dedicated"], engines["shared"]]
    turns = ["My name is Ada and my cat is called Turing.", "I live in Paris.", "What is my cat called?"]
    port_a = free_port()
    with _gateway(configs[0], redis_server.url, port=port_a) as gw_a, _gateway(configs[1], redis_server.url) as gw_b:
        gateways = [gw_a, gw_b, gw_a]
        served = [0, 1, 0]
        conversation: list[dict[str, str]] = []
        previous = None
        answers = []
        for text, gw, replica in zip(turns, gateways, served):
            before = [_prompt_tokens(r) for r in replicas]
            with _client(gw) as client:
                r = client.responses.create(model=MODEL, input=text, previous_response_id=previous,
                                            max_output_tokens=6, temperature=0)
            conversation += [{"role": "user", "content": text}]
            # The replica received the whole conversation: exactly the template's count of it ...
            assert r.usage.input_tokens == _tokens(replicas[replica], conversation)
            # ... and it was this gateway's replica that received it, not the other.
            _wait_for(lambda: _prompt_tokens(replicas[replica]) - before[replica] == r.usage.input_tokens)
            assert _prompt_tokens(replicas[1 - replica]) == before[1 - replica]
            conversation += [{"role": "assistant", "content": r.output_text}]
            previous = r.id
            answers.append(r)
        # The first turn's fact is in the third turn's prompt (its tokens are the first message's too).
        assert answers[2].usage.input_tokens > answers[1].usage.input_tokens > answers[0].usage.input_tokens
        for gw in (gw_a, gw_b):  # another key: none of them exist
            with _client(gw, OTHER_KEY) as other:
                for r in answers:
                    with pytest.raises(openai.NotFoundError):
                        other.responses.retrieve(r.id)
                with pytest.raises(openai.NotFoundError):
                    other.responses.create(model=MODEL, input="x", previous_response_id=answers[-1].id,
                                           max_output_tokens=2)
                with pytest.raises(openai.NotFoundError):
                    other.responses.delete(answers[0].id)
        with _client(gw_b) as client:
            assert client.responses.retrieve(answers[0].id).output_text == answers[0].output_text
    # Gateway A again, a new process on the same port (and a short TTL): the store is in Redis.
    with _gateway(configs[0], redis_server.url, "--response-ttl", "2", port=port_a) as gw_a2, _client(gw_a2) as client:
        assert client.responses.retrieve(answers[2].id).output_text == answers[2].output_text
        fourth = client.responses.create(model=MODEL, input="And my city?", previous_response_id=answers[2].id,
                                         max_output_tokens=2)
        assert fourth.usage.input_tokens == _tokens(replicas[0], conversation + [
            {"role": "user", "content": "And my city?"}])
        client.responses.delete(answers[0].id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(answers[0].id)
        # What this gateway stores lives 2 s.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                client.responses.retrieve(fourth.id)
            except openai.NotFoundError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the response did not expire")
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL, input="x", previous_response_id=fourth.id, max_output_tokens=2)


def test_streamed_turn_is_stored_before_it_completes(configs: list[Path], engines: dict[str, str],
                                                     redis_server: Any) -> None:
    """A streamed response is in the store when response.completed reaches the client: a follow-up
    sent at once through the other gateway finds it."""
    with _gateway(configs[0], redis_server.url) as gw_a, _gateway(configs[1], redis_server.url) as gw_b:
        with _client(gw_a) as a, a.responses.stream(model=MODEL, input="Stream me.", max_output_tokens=3) as stream:
            events = list(stream)
        first = events[-1].response
        with _client(gw_b) as b:
            second = b.responses.create(model=MODEL, input="Next.", previous_response_id=first.id,
                                        max_output_tokens=2)
        assert second.usage.input_tokens == _tokens(engines["shared"], [
            {"role": "user", "content": "Stream me."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Next."}])
