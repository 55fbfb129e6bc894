"""The engine dashboard's block map for a pool shared by KV groups, in a real browser against a real
``pagedserve serve`` of a tiny Gemma 3 (one full-attention group, two 32-token window groups): the
page lists the groups, its per-group counts add up to /load's while requests run, the window
groups hold fewer blocks than the full group once past their window, and at idle every group has
cached the same blocks (the count the requests' tokens give) with none in use."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.servers import run_paced_engine_server, wait_for_idle

BLOCK = 16
ARGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-num-batched-tokens", "64",
        "--served-model-name", "tiny-gemma3", "--log-level", "warning")


@pytest.fixture(scope="module")
def server(tiny_gemma3_gguf: Path, tiny_model_dir: Path) -> Any:
    # The `tiny` model's tokenizer: the file's own (transformers' Gemma tokenizer, 262k tokens) took
    # the front ~10 s to load twice, and the page shows blocks, which no text of this noise needs.
    # Every step 10 ms longer (tests/helpers/faults.py's Paced): the requests below run for seconds
    # on any CPU, not for as long as the polling needs on a slow one only.
    with run_paced_engine_server(tiny_gemma3_gguf, 0.01, *ARGS, "--tokenizer", str(tiny_model_dir), timeout=300) as url:
        yield url


def _groups(page: Any) -> dict[int, dict[str, Any]]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#kv-groups tbody tr')].map(
        r => [r.dataset.group, {kind: r.dataset.kind, used: +r.dataset.used, cached: +r.dataset.cached}]))""")


def _open(page: Any, url: str) -> None:
    page.goto(f"{url}/dashboard")
    page.wait_for_selector("#conn[data-state=live]", timeout=10_000)


def test_the_block_map_shows_each_kv_group(server: str, page: Any, tmp_path: Path) -> None:
    _open(page, server)
    assert page.locator("#kv-groups").is_hidden(), "no group is shown before a block belongs to one"
    # Two requests of ~155-token prompts and 340 tokens each (496 of the 512 positions): far past the
    # 32-token window, and long enough that the polling below sees the page and /load agree while
    # they run (with 80 tokens the tiny model finished them between a few polls on a loaded CI
    # machine; with 240, once in a clean-clone CI run on 2 busy cores).
    results: list[Any] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=180) as c:
                results.append(c.completions.create(model="tiny-gemma3", prompt=f"request {i}: " + "words go by " * 50,
                                                    max_tokens=340, extra_body={"ignore_eos": True}))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    # While they run: a moment where the page's per-group counts add up to what /load said within
    # the last second and each window group holds fewer blocks than the full group (both move every
    # step, so poll until one is seen). The page's snapshot is up to a stream tick (0.1 s) and a
    # publication behind /load: on a Sapphire Rapids-class Xeon the tiny model's counts moved faster
    # than that, and a match against only the reads just before and after the page's never came.
    seen = False
    recent: collections.deque[tuple[float, int]] = collections.deque()
    deadline = time.monotonic() + 180

    def read_load() -> None:
        now = time.monotonic()
        recent.append((now, httpx.get(f"{server}/load", timeout=5).json()["kv_blocks_used"]))
        while recent[0][0] < now - 1.0:
            recent.popleft()

    while any(t.is_alive() for t in threads) and time.monotonic() < deadline and not seen:
        read_load()
        groups = _groups(page)
        read_load()
        if groups and sum(g["used"] for g in groups.values()) in {used for _, used in recent} - {0}:
            full = [g["used"] for g in groups.values() if g["kind"] == "full"]
            window = [g["used"] for g in groups.values() if g["kind"] == "window"]
            seen = len(full) == 1 and len(window) == 2 and max(window) < full[0]
            if seen:
                page.screenshot(path=str(tmp_path / "engine-dashboard-groups-running.png"), full_page=True)
        time.sleep(0.05)
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert seen, "the page never showed the window groups holding fewer blocks than the full group"
    assert page.locator("#colour-by-label").is_visible() and page.locator("#colour-by").input_value() == "group"
    assert "per KV group" in page.locator("#legend-owned").inner_text()
    # Idle: within a second of /load saying so, every group shows the blocks both requests cached.
    load = wait_for_idle(server, timeout=20)
    assert load["kv_blocks_used"] == 0 and load["running"] == 0, load
    want = sum((r.usage.prompt_tokens + r.usage.completion_tokens - 1) // BLOCK for r in results)
    expected = {"0": {"kind": "full", "used": 0, "cached": want}, "1": {"kind": "window", "used": 0, "cached": want},
                "2": {"kind": "window", "used": 0, "cached": want}}
    deadline = time.monotonic() + 1.0
    while _groups(page) != expected:
        assert time.monotonic() < deadline, f"the page shows {_groups(page)}, not {expected}"
        time.sleep(0.05)
    assert 3 * want == load["kv_blocks_cached"]
    kinds = page.locator("#kv-kinds")
    assert kinds.get_attribute("data-full-cached") == str(want) and kinds.get_attribute("data-window-cached") == str(2 * want)
    page.screenshot(path=str(tmp_path / "engine-dashboard-groups.png"), full_page=True)
