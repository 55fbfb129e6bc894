"""The engine dashboard in a real browser, against a real ``pagedserve serve`` (core in its own
process) with an API key and a pool small enough that requests preempt each other and evict
cached prefixes: the grid's block counts follow /load, preemptions and evictions are logged, the
feed needs the key, and it comes back by itself after the server restarts."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.servers import free_port, run_engine_server, run_paced_engine_server, wait_for_idle

KEY = "dash-key"
NUM_BLOCKS = 12  # 192 token slots: three requests of ~100 tokens cannot all fit
ROUNDS = 20  # most rounds of the three requests the grid test runs (it stops once it saw the pool mid-run)
# Each model step of the module's server takes this much longer (tests/helpers/faults.py's Paced):
# the pool then moves a block every few page ticks on any CPU. Unpaced, the tiny model crossed
# several block boundaries between two polls on a fast Zen 5, and in one clean-clone run 20 rounds
# of the grid test passed without the page ever showing a pair /load had reported.
STEP_S = 0.01
ARGS = ("--max-model-len", "256", "--max-num-seqs", "4", "--api-key", KEY, "--served-model-name", "tiny",
        "--log-level", "warning")


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def running(tiny_model_dir: Path, port: int) -> Iterator[contextlib.ExitStack]:
    """The module's server; the restart test (the module's last) stops it early through this stack."""
    with contextlib.ExitStack() as stack:
        stack.url = stack.enter_context(run_paced_engine_server(  # type: ignore[attr-defined]
            tiny_model_dir, STEP_S, *ARGS, "--num-kv-blocks", str(NUM_BLOCKS), timeout=300, port=port))
        yield stack


@pytest.fixture
def server(running: contextlib.ExitStack) -> str:
    return running.url  # type: ignore[attr-defined,no-any-return]


def _grid(page: Any) -> dict[str, int]:
    return page.evaluate("""() => { const d = document.getElementById('grid').dataset;
        return {used: +d.used, cached: +d.cached, free: +d.free, total: +d.total, version: +d.version}; }""")


def _wait_grid(page: Any, want: dict[str, int], timeout: float = 1.0) -> dict[str, int]:
    """Poll the page until its grid shows ``want`` (a subset of _grid's keys); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = _grid(page)
        if all(got[k] == v for k, v in want.items()):
            return got
        assert time.monotonic() < deadline, f"the grid shows {got}, not {want}, after {timeout}s"
        time.sleep(0.05)


def _open(page: Any, url: str) -> None:
    page.goto(f"{url}/dashboard")
    page.wait_for_selector("#conn[data-state=unauthorized]", timeout=10_000)
    page.fill("#key", KEY)
    page.click("#auth button")
    page.wait_for_selector("#conn[data-state=live]", timeout=10_000)


def _load(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/load", timeout=5).json()


def test_the_feed_needs_the_api_key(server: str) -> None:
    assert httpx.get(f"{server}/dashboard", timeout=5).status_code == 200, "the page itself holds no data"
    r = httpx.get(f"{server}/dashboard/events", timeout=5)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with httpx.stream("GET", f"{server}/dashboard/events", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=5) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        first = next(s.iter_text())
        assert "retry:" in first


def test_grid_follows_load_and_shows_preemptions_and_evictions(server: str, page: Any, tmp_path: Path) -> None:
    _open(page, server)
    _wait_grid(page, {"total": NUM_BLOCKS}, timeout=5)
    # Three concurrent requests of 40 + 60 tokens want 3 x 7 blocks of a 12-block pool: the newest
    # is preempted, and its (and finished requests') cached blocks are evicted for reuse. On a fast
    # CPU one round ends within half a second, between two polls of the page: each client repeats
    # its request (new text each round) until the moment below has been seen, at most ROUNDS times.
    errors: list[BaseException] = []
    seen = threading.Event()

    def run(i: int) -> None:
        try:
            with openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=180) as c:
                for r in range(ROUNDS):
                    if r and seen.is_set():
                        return
                    c.completions.create(model="tiny", prompt=f"request {i} round {r} " + "word " * 34,
                                         max_tokens=60, extra_body={"ignore_eos": True})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # While they run: the grid shows, at some moment, what /load reported within the last second
    # (both move every step; the page's snapshot is up to a stream tick, 0.1 s, and a publication
    # behind /load: with the tiny model's faster steps a match against only the read just before
    # the page's came in some runs and not in others, as in the KV-groups page's test).
    matched = False
    states: set[str] = set()  # the request list's states seen while they ran
    recent: collections.deque[tuple[float, tuple[int, int]]] = collections.deque()
    deadline = time.monotonic() + 180
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        load = _load(server)
        now = time.monotonic()
        recent.append((now, (load["kv_blocks_used"], load["kv_blocks_cached"])))
        while recent[0][0] < now - 1.0:
            recent.popleft()
        g = _grid(page)
        if g["used"] > 0 and (g["used"], g["cached"]) in {pair for _, pair in recent}:
            if not matched:  # the pool mid-run (docs/img/dashboard.png is one of these)
                page.screenshot(path=str(tmp_path / "engine-dashboard-running.png"), full_page=True)
            matched = True
        states.update(page.evaluate(
            "() => [...document.querySelectorAll('#requests tbody tr')].map(r => r.dataset.state)"))
        if matched and "running" in states:
            seen.set()
        time.sleep(0.1)
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert matched, "the grid never showed the blocks /load reported while requests ran"
    assert "running" in states, states
    page.wait_for_selector("#events li[data-kind=preemption]", timeout=5_000)
    page.wait_for_selector("#events li[data-kind=eviction]", timeout=5_000)
    counters = page.locator("#counters")
    assert int(counters.get_attribute("data-preemptions")) >= 1
    assert int(counters.get_attribute("data-evictions")) >= 1
    # Idle: within a second of /load saying so, the grid shows exactly its figures.
    load = wait_for_idle(server, timeout=20)
    assert load["kv_blocks_used"] == 0 and load["running"] == 0, load
    _wait_grid(page, {"used": 0, "cached": load["kv_blocks_cached"],
                      "free": NUM_BLOCKS - load["kv_blocks_cached"]}, timeout=1.0)
    assert load["kv_blocks_cached"] > 0
    assert page.locator("#requests tbody tr").count() == 0
    # one table for every layer: no KV group list, no colour-by-group choice (tests/web/test_engine_dashboard_groups.py)
    assert page.locator("#kv-groups").is_hidden() and page.locator("#colour-by-label").is_hidden()
    assert "per request" in page.locator("#legend-owned").inner_text()
    page.screenshot(path=str(tmp_path / "engine-dashboard.png"), full_page=True)


def test_feed_survives_a_server_restart(server: str, running: contextlib.ExitStack, page: Any,
                                        tiny_model_dir: Path, port: int) -> None:
    _open(page, server)
    _wait_grid(page, {"total": NUM_BLOCKS}, timeout=5)
    # Stop the module's server: an open feed must not hold up its shutdown.
    t0 = time.monotonic()
    running.close()
    assert time.monotonic() - t0 < 10, "the open dashboard feed held up the server's shutdown"
    page.wait_for_selector("#conn[data-state=reconnecting], #conn[data-state=connecting]", timeout=5_000)
    # A new server on the same port, with another pool size: the page picks it up by itself,
    # the key still in its sessionStorage.
    with run_engine_server(tiny_model_dir, *ARGS, "--num-kv-blocks", "32", timeout=300, port=port) as url:
        page.wait_for_selector("#conn[data-state=live]", timeout=15_000)
        _wait_grid(page, {"total": 32, "free": 32, "used": 0}, timeout=5)
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            c.completions.create(model="tiny", prompt="after the restart", max_tokens=20)
        load = wait_for_idle(url)
        assert load["kv_blocks_used"] == 0, load
        _wait_grid(page, {"used": 0, "cached": load["kv_blocks_cached"]}, timeout=1.0)

