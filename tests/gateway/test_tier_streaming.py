"""A tier's ``stream_interval``: the gateway asks the replica for one event per N tokens on that
tier's streamed requests, keeps a client's coarser choice, and leaves other requests alone."""

from __future__ import annotations

import httpx
import pytest

from pagedserve.bench.tiers import TiersBenchConfig, gateway_toml
from pagedserve.gateway.config import parse_config
from tests.gateway.conftest import MODEL
from tests.gateway.gateway_server import GatewayThread
from tests.gateway.stub_replica import StubReplica
from tests.gateway.test_replica_faults import AUTH, PROMPT, _config, _stream_lines


@pytest.mark.parametrize("asked, sent", [(None, 4), (2, 4), (8, 8), ("x", "x")])
def test_a_tier_interval_reaches_the_replica_on_streams(asked, sent) -> None:
    with StubReplica(status=200, stream_events=2, stream_end="done") as stub, \
            GatewayThread(_config(stub.url, tier_extra="stream_interval = 4")) as gw:
        body = {"prompt": PROMPT, "max_tokens": 8} | ({} if asked is None else {"stream_interval": asked})
        lines = _stream_lines(gw, body)
        assert lines[-1] == "data: [DONE]"
        # A client's coarser choice stands; a value that is no whole number is the replica's to refuse.
        assert stub.last_body["stream_interval"] == sent


def test_plain_requests_and_tiers_without_an_interval_are_left_alone() -> None:
    with StubReplica(status=200) as stub, GatewayThread(_config(stub.url, tier_extra="stream_interval = 4")) as gw:
        r = httpx.post(f"{gw.url}/v1/completions", headers=AUTH,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8}, timeout=10)
        assert r.status_code == 200, r.text
        assert "stream_interval" not in stub.last_body  # not streamed: nothing to space out
    with StubReplica(status=200, stream_events=1, stream_end="done") as stub, GatewayThread(_config(stub.url)) as gw:
        _stream_lines(gw, {"prompt": PROMPT, "max_tokens": 8})
        assert "stream_interval" not in stub.last_body  # the default tier: every token


def test_w6_can_space_the_free_tier_only() -> None:
    cfg = parse_config(gateway_toml(["http://127.0.0.1:1"], TiersBenchConfig(free_stream_interval=4), 8080))
    assert (cfg.tiers["paid"].stream_interval, cfg.tiers["free"].stream_interval) == (1, 4)
    assert parse_config(gateway_toml(["http://127.0.0.1:1"], TiersBenchConfig(), 8080)).tiers["free"].stream_interval == 1
