"""The load generators' aiohttp client against the shared server: W6's shot, a stream's data lines."""

from __future__ import annotations

import asyncio

from pagedserve.bench.sse_client import stream_post
from pagedserve.bench.sse_client import session as sse_session
from pagedserve.bench.tiers import _shot


def test_w6_shot_times_the_first_event_and_reads_the_error_code(server_url: str, model_name: str) -> None:
    async def run() -> tuple:
        async with sse_session(server_url, 60) as http:
            ok = await _shot(http, "paid", list(range(1000, 1016)), 4, model=model_name)
            # W6's own model name, which this server does not serve: refused before any work
            return ok, await _shot(http, "free", [1000, 1001], 2)

    ok, refused = asyncio.run(run())
    assert ok.status == 200 and ok.code is None and ok.ttft is not None and 0 < ok.ttft < 60
    assert ok.request_id.startswith("w6-paid-")
    assert refused.status == 404 and refused.code == "model_not_found" and refused.ttft is None


def test_stream_post_yields_every_event_then_done(server_url: str, model_name: str) -> None:
    body = {"model": model_name, "prompt": list(range(1000, 1016)), "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True, "stream": True}

    async def run() -> tuple[int, list[str]]:
        async with sse_session(server_url, 60) as http, stream_post(http, "/v1/completions", body) as r:
            return r.status, [d async for d in r.data_lines()]

    status, lines = asyncio.run(run())
    assert status == 200
    assert lines[-1] == "[DONE]" and all(line.startswith("{") for line in lines[:-1])
    assert len(lines) - 1 == 5  # one event per token at the default stream interval
