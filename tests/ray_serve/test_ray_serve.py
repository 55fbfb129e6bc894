"""pagedserve on Ray Serve: one local Ray cluster (2 CPUs) for the module, the front and 2 replicas
of the `tiny` model. Shared-prefix requests stick to one replica (the replica id header), skewed
load overrides that affinity, an overfull queue is a 503 with OpenAI's body, a replica killed
mid-run fails its streams cleanly and later traffic goes to a live one, and Serve shuts down clean.
Every test leaves every live replica with no request and no KV block in use."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'pagedserve[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'pagedserve[ray]')")

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.ray_serve import app as ray_app  # noqa: E402
from pagedserve.ray_serve.replica import REPLICA_HEADER  # noqa: E402
from pagedserve.ray_serve.settings import RaySettings  # noqa: E402
from pagedserve.server.config import ServerConfig  # noqa: E402
from tests.helpers.servers import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"
SEATS = 2  # max_num_seqs of each replica's engine
SETTINGS = RaySettings(
    num_replicas=2, replica_num_cpus=0.5, max_ongoing_requests=4, max_queued_requests=2,
    # Affinity holds while the prefix's replica is as free as the best (an idle pair ties), and
    # gives way to any wait at all: the skew test does not depend on timings of this machine.
    affinity_slack_s=0.0, default_service_s=2.0, routing_stats_period_s=0.2, retries=1,
    # Nothing routes here once a test stops Serve: its replicas need not wait Ray's 2 s before draining.
    drain_check_s=0.2)
# A system prompt longer than the 512 characters the prefix key covers (pagedserve.gateway.pools.prefix_key).
SHARED = ("You are a helpful assistant for a weather service. Answer in one short sentence, be kind, never "
          "guess a forecast you were not given, and say so when you do not know. " * 4) + "Question: "


class Cluster:
    """The running application: its URL, and the replicas' own load reports."""

    def __init__(self, url: str):
        self.url = url
        self.seen: set[str] = set()  # replica ids that answered
        self.killed: set[str] = set()

    def post(self, body: dict[str, Any], **kw: Any) -> httpx.Response:
        r = httpx.post(f"{self.url}/v1/completions", json={"model": MODEL, **body}, timeout=60, **kw)
        if REPLICA_HEADER in r.headers:
            self.seen.add(r.headers[REPLICA_HEADER])
        return r

    @staticmethod
    def actor(replica_id: str) -> Any:
        # Serve names each replica's actor SERVE_REPLICA::<app>#<deployment>#<replica id>.
        return ray.get_actor(f"SERVE_REPLICA::{SETTINGS.app_name}#engine#{replica_id}", namespace="serve")

    def load(self, replica_id: str) -> dict[str, Any]:
        """The replica's engine load (what its routing stats report), asked of the replica itself."""
        return ray.get(self.actor(replica_id).record_routing_stats.remote(), timeout=10)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Every live replica that answered ends with nothing running or waiting and 0 KV blocks used."""
        for rid in self.seen - self.killed:
            deadline = time.monotonic() + timeout
            while True:
                load = self.load(rid)
                if load["running"] == 0 and load["waiting"] == 0 and load["kv_blocks_used"] == 0:
                    break
                assert time.monotonic() < deadline, f"replica {rid} not idle: {load}"
                time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    ray_app.init_ray(num_cpus=2, log_to_driver=False)
    try:
        # The native kernels are not the point here: no replica waits on their first compile.
        engine = EngineConfig(model=str(tiny_model_dir), max_num_seqs=SEATS, num_kv_blocks=512, max_model_len=4096,
                              native_kernels=False)
        server = ServerConfig(host="127.0.0.1", port=free_port(), served_model_name=MODEL, shutdown_timeout_s=1.0)
        yield Cluster(ray_app.start(engine, server, SETTINGS))
    finally:
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()


@pytest.fixture
def app(cluster: Cluster) -> Iterator[Cluster]:
    yield cluster
    cluster.wait_idle()


def test_shared_prefix_sticks_to_one_replica(app: Cluster) -> None:
    # The official client, through the front; the replica id comes back as a header.
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=SHARED + "why is the sky blue?",
                                                      max_tokens=4, extra_body={"ignore_eos": True})
    first = raw.headers[REPLICA_HEADER]
    assert raw.parse().usage.completion_tokens == 4
    app.seen.add(first)
    for q in ["what is rain?", "how do birds fly?", "why is grass green?", "what is a cloud?"]:
        r = app.post({"prompt": SHARED + q, "max_tokens": 4, "stream": q.startswith("how")})
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] == first
    # Distinct prefixes on an idle pair are spread (ties go round-robin), so the stickiness above
    # was the affinity, not a router that only knows one replica.
    spread = {app.post({"prompt": f"{i} unrelated prompt number {i}", "max_tokens": 2}).headers[REPLICA_HEADER]
              for i in range(6)}
    assert len(spread) == 2, spread
    # Bad input is the replica app's 400 with OpenAI's body, through the front; an oversized body the front's 413.
    bad = app.post({"prompt": SHARED, "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    big = app.post({"prompt": "x" * (5 * 1024 * 1024)})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"


def test_skewed_load_overrides_affinity(app: Cluster) -> None:
    prefix = SHARED + "Long answers please. "
    long_body = {"prompt": prefix + "tell a story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    # Both seats of the prefix's replica taken by streams of the same prefix (affinity, no wait yet).
    # Affinity puts them on one replica unless it answered Ray's room probe late (then Ray tries the
    # next: once in a clean-clone CI run): that is the setup missing, not the behaviour under test,
    # so it is tried again, at most three times, from idle replicas.
    placed: list[list[str]] = []
    for _ in range(3):
        with httpx.Client(base_url=app.url, timeout=60) as c, contextlib.ExitStack() as stack:
            homes, readers = [], []
            for _ in range(SEATS):
                r = stack.enter_context(c.stream("POST", "/v1/completions", json={"model": MODEL, **long_body}))
                assert r.status_code == 200
                # Keep the reader: a dropped line iterator closes its connection (the client left).
                readers.append(r.iter_lines())
                next(readers[-1])  # running: the first event came
                homes.append(r.headers[REPLICA_HEADER])
            app.seen.update(homes)
            placed.append(homes)
            if len(set(homes)) == 1:
                # The same prefix again would queue there: it goes to the other replica.
                r = app.post({"prompt": prefix + "a short one", "max_tokens": 2})
                assert r.status_code == 200 and r.headers[REPLICA_HEADER] != homes[0], (homes, r.headers, app.seen)
                break
        # Leaving the block closed the streams: their engine requests are aborted (checked by `app`).
        app.wait_idle()
    assert len(set(placed[-1])) == 1, placed


def test_overfull_queue_is_503_with_openai_body(app: Cluster) -> None:
    body = {"prompt": "flood", "max_tokens": 200, "ignore_eos": True}
    n = SETTINGS.num_replicas * SETTINGS.max_ongoing_requests + SETTINGS.max_queued_requests + 6
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(lambda i: app.post({**body, "prompt": f"flood {i}"}), range(n)))
    codes = sorted(r.status_code for r in answers)
    full = [r for r in answers if r.status_code == 503]
    assert full, codes
    assert all(r.json()["error"]["code"] == "queue_full" and r.headers["Retry-After"] == "1" for r in full)
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= SETTINGS.num_replicas * SEATS, codes


def test_killed_replica_fails_cleanly_then_traffic_goes_to_the_live_one(app: Cluster) -> None:
    prefix = SHARED + "About to die. "
    body = {"model": MODEL, "prompt": prefix + "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=app.url, timeout=30) as c, contextlib.ExitStack() as stack:
        opened = [stack.enter_context(c.stream("POST", "/v1/completions", json=body)) for _ in range(SEATS)]
        # Affinity puts them on one replica, unless that replica answered Ray's room probe late on a
        # busy host (then Ray tries the next): streams elsewhere are closed, the first one's replica dies.
        victim = opened[0].headers[REPLICA_HEADER]
        streams = [r for r in opened if r.headers[REPLICA_HEADER] == victim]
        for r in opened:
            if r not in streams:
                r.close()
        lines = [r.iter_lines() for r in streams]
        for it in lines:
            next(it)
        app.killed.add(victim)
        ray.kill(app.actor(victim), no_restart=True)
        t0 = time.monotonic()
        for it in lines:  # each stream ends, never hangs: an error event then [DONE], or a cut connection
            tail: list[str] = []
            with contextlib.suppress(httpx.RemoteProtocolError, httpx.ReadError):
                for line in it:
                    if line:
                        tail.append(line)
            assert not tail or tail[-1] == "data: [DONE]", tail[-3:]
            if tail:
                assert any('"engine_unavailable"' in line for line in tail[-2:]), tail[-3:]
        assert time.monotonic() - t0 < 20
    # Later traffic, the dead replica's prefix included, is served by a live replica.
    for i in range(4):
        r = app.post({"prompt": prefix + f"after {i}", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] != victim


def test_clean_shutdown(cluster: Cluster) -> None:
    t0 = time.monotonic()
    serve.shutdown()
    ray.shutdown()
    assert time.monotonic() - t0 < 30
    assert not ray.is_initialized()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{cluster.url}/health", timeout=2)
