"""Clients that hang up mid-request are aborted and their KV blocks freed."""

from __future__ import annotations

import asyncio
import re

import httpx

from tests.helpers.servers import wait_for_idle

N_CLIENTS = 20


def aborted_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r'^pagedserve_request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def _hang_up_mid_stream(url: str, i: int) -> int:
    """Open a long stream, read two events, then close the connection. Returns events read.
    16 sequences of 200 tokens per client, 320 in all: seconds of work at any speed, where 20 single
    ones finished on a fast CPU before their hang-ups were seen (once in a clean-clone CI run)."""
    body = {"prompt": f"client {i} says", "max_tokens": 200, "n": 16, "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 2:
                        break
    return events


def test_twenty_clients_hang_up_mid_stream(server_url: str) -> None:
    before = aborted_total(server_url)

    async def main() -> list[int]:
        return await asyncio.gather(*(_hang_up_mid_stream(server_url, i) for i in range(N_CLIENTS)))

    assert asyncio.run(main()) == [2] * N_CLIENTS
    load = wait_for_idle(server_url, timeout=10)
    assert load["kv_blocks_used"] == 0 and load["running"] == 0, load
    # They were aborted, not run to completion (16 x 200 tokens each would take far longer).
    assert aborted_total(server_url) - before == N_CLIENTS
    r = httpx.post(f"{server_url}/v1/completions", json={"prompt": "after", "max_tokens": 4, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_non_streamed_client_timeout_aborts(server_url: str) -> None:
    before = aborted_total(server_url)
    # 24 × 240 tokens: ~1.2 s on a 2-core Zen 4, where n=4 (0.35 s) outran the 0.3 s client timeout.
    body = {"prompt": "slow", "max_tokens": 240, "ignore_eos": True, "n": 24}
    try:
        httpx.post(f"{server_url}/v1/completions", json=body, timeout=0.3)
        raise AssertionError("expected the client to time out")
    except httpx.TimeoutException:
        pass
    load = wait_for_idle(server_url, timeout=10)
    assert load["kv_blocks_used"] == 0, load
    assert aborted_total(server_url) - before == 1
