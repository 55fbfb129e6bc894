"""The gateway dashboard in a real browser: a real gateway in front of a real engine (in-process,
on its step thread, which also shows the engine page off the in-process client); a flood of one
tier's requests is shed with 429 and the page shows it by reason, beside the other tier's
admitted requests and the pool's replica."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.async_engine import AsyncEngine
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.gateway.config import parse_config
from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from tests.gateway.gateway_server import GatewayThread
from tests.helpers.servers import AppThread, wait_for_idle

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """A real engine server, in-process (AsyncEngine): its open feeds end when the thread stops."""
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, max_num_seqs=4))
    app = build_app(AsyncEngine(core), ServerConfig(served_model_name=MODEL))
    with AppThread(app, lifespan="on") as t:
        app.state.dashboard.should_stop = lambda: t.server.should_exit
        yield t.url
        load = wait_for_idle(t.url)
        assert load["kv_blocks_used"] == 0, load


@pytest.fixture
def gateway(engine_url: str) -> Iterator[GatewayThread]:
    config = parse_config(f"""
[gateway]
load_poll_interval_s = 0.1

[pools.main]
replicas = ["{engine_url}"]

[tiers.paid]
token_rate = 100000
token_burst = 100000
pools = ["main"]
priority = 0

[tiers.free]
token_rate = 1
token_burst = 150
pools = ["main"]
priority = 5
default_max_tokens = 8

[keys]
"sk-paid" = "paid"
"sk-free" = "free"
""")
    with GatewayThread(config) as gw:
        gw.app.state.dashboard.should_stop = lambda: gw.server.should_exit
        yield gw


def _complete(url: str, key: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 8})


def test_gateway_page_shows_a_flood_shed_with_429(gateway: GatewayThread, engine_url: str, page: Any,
                                                  tmp_path: Path) -> None:
    page.goto(f"{gateway.url}/dashboard")
    page.wait_for_selector("#conn[data-state=live]", timeout=10_000)
    page.wait_for_selector(f"#pools tr[data-replica='{engine_url}'][data-healthy='1']", timeout=5_000)
    for i in range(3):
        assert _complete(gateway.url, "sk-paid", f"paid request {i}").status_code == 200
    codes = [_complete(gateway.url, "sk-free", f"free flood {i} " + "x " * 20).status_code for i in range(8)]
    assert 429 in codes and 200 in codes, codes  # the burst admits some, then the bucket is empty
    shed = codes.count(429)
    page.wait_for_selector(f"#tiers tr[data-tier=free][data-shed='{shed}']", timeout=3_000)
    page.wait_for_selector("#tiers tr[data-tier=free] [data-reason=rate_limited_tokens]", timeout=1_000)
    paid = page.locator("#tiers tr[data-tier=paid]")
    assert paid.get_attribute("data-admitted") == "3" and paid.get_attribute("data-shed") == "0"
    assert page.locator("#tiers tr[data-tier=free]").get_attribute("data-admitted") == str(codes.count(200))
    page.screenshot(path=str(tmp_path / "gateway-dashboard.png"), full_page=True)


def test_engine_page_from_the_in_process_engine_and_offline_docs(engine_url: str, page: Any) -> None:
    """The same page as the core-process server's, fed by AsyncEngine's step thread; /docs loads
    Swagger UI from the server itself (every request the page makes stays on this origin)."""
    outside: list[str] = []
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(engine_url) else None)
    page.goto(f"{engine_url}/")
    page.wait_for_selector("#conn[data-state=live]", timeout=10_000)
    page.wait_for_function("document.getElementById('grid').dataset.total === '64'", timeout=5_000)
    r = httpx.post(f"{engine_url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "one two three " * 10, "max_tokens": 4})
    assert r.status_code == 200
    load = wait_for_idle(engine_url)
    deadline = time.monotonic() + 1.0
    while True:
        grid = page.evaluate("() => ({...document.getElementById('grid').dataset})")
        if grid["used"] == "0" and grid["cached"] == str(load["kv_blocks_cached"]):
            break
        assert time.monotonic() < deadline, (grid, load)
        time.sleep(0.05)
    page.goto(f"{engine_url}/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=10_000)  # rendered from /openapi.json
    assert not outside, f"the pages fetched from elsewhere: {outside}"
