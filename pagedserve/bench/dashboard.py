"""``pagedserve bench dashboard``: what watching the dashboard costs the engine.

W1's 64 requests (prompts 64-512, outputs 32-256 tokens, seed 0, greedy, ``ignore_eos``) are sent
at once to one ``pagedserve serve`` (engine core in its own process), alternately with nobody
watching and with a viewer on ``/dashboard/events`` reading and decoding every event as the page
does; output tokens/s of each run, the median per condition and their ratio, in one run. The
viewer is an SSE client in this process, not a browser: the browser's drawing runs on the
viewer's machine, while what the server pays (the core's snapshots, the front end's deltas and
encoding) is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field

import httpx

from pagedserve.bench.common import median, resolve_model, write_result
from pagedserve.bench.processes import engine_server
from pagedserve.bench.workloads import BenchRequest, w1_offline


@dataclass
class Viewer:
    """Reads the dashboard feed on a thread, decoding every event's JSON as the page would."""

    url: str
    api_key: str | None = None
    events: dict[str, int] = field(default_factory=dict)
    build_ms: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Viewer:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the dashboard feed did not answer")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self, ready: threading.Event) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.stream("GET", f"{self.url}/dashboard/events", headers=headers, timeout=60) as resp:
            resp.raise_for_status()
            ready.set()
            name = ""
            for line in resp.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    body = json.loads(line[6:])
                    self.events[name] = self.events.get(name, 0) + 1
                    if "build_ms" in body:
                        self.build_ms.append(body["build_ms"])


async def _run_batch(url: str, model: str, reqs: list[BenchRequest], api_key: str | None,
                     cache_salt: str) -> tuple[float, int]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(reqs) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits, headers=headers) as http:
        async def one(r: BenchRequest) -> int:
            resp = await http.post(f"{url}/v1/completions", json={
                "model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len, "temperature": 0,
                "ignore_eos": True, "cache_salt": cache_salt})
            resp.raise_for_status()
            return int(resp.json()["usage"]["completion_tokens"])
        start = time.perf_counter()
        produced = await asyncio.gather(*(one(r) for r in reqs))
        return time.perf_counter() - start, sum(produced)


def add_parser(bench: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench.add_parser("dashboard", help="W1 through the server with the dashboard watched vs not: the ratio",
                         description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (W1: 64)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per condition, alternating unwatched / watched (default 3; median reported)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for `pagedserve serve` (repeatable), e.g. --server-arg=--kv-cache-memory=2GiB")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    model_dir = resolve_model(args.model)
    reqs = w1_offline(args.num_requests)
    model = "bench"
    with engine_server("--model", model_dir, "--served-model-name", model, "--log-level", "warning",
                       *args.server_arg) as url:
        asyncio.run(_run_batch(url, model, reqs[:8], None, "warm-up"))
        rates: dict[str, list[float]] = {"unwatched": [], "watched": []}
        viewers: list[Viewer] = []
        for i in range(args.repeats):
            for condition in ("unwatched", "watched"):
                # Every run has its own cache salt: the same W1 prompts again would otherwise hit
                # the prefix cache that the previous run left, and the later runs would be faster.
                salt = f"run-{i}-{condition}"
                if condition == "watched":
                    with Viewer(url) as viewer:
                        seconds, produced = asyncio.run(_run_batch(url, model, reqs, None, salt))
                    viewers.append(viewer)
                else:
                    seconds, produced = asyncio.run(_run_batch(url, model, reqs, None, salt))
                rates[condition].append(produced / seconds)
                print(f"  run {i + 1} {condition:>9}: {seconds:7.2f} s  {produced / seconds:8.1f} output tok/s")
    off, on = median(rates["unwatched"]), median(rates["watched"])
    snapshots = sum(v.events.get("full", 0) + v.events.get("delta", 0) for v in viewers)
    builds = [ms for v in viewers for ms in v.build_ms]
    result = {"workload": "W1 via the server, dashboard watched vs unwatched", "model": args.model,
              "requests": len(reqs), "unwatched_output_tok_s": rates["unwatched"],
              "watched_output_tok_s": rates["watched"], "ratio_watched_over_unwatched": on / off,
              "snapshots_received": snapshots, "snapshot_build_ms_median": median(builds)}
    print(f"\nW1 ({args.model}, {len(reqs)} requests, all at once): unwatched {off:.1f}, watched {on:.1f} output tok/s"
          f" (medians of {args.repeats}); ratio watched / unwatched = {on / off:.3f}; {snapshots} block-map "
          f"events received, snapshot build median {median(builds):.2f} ms")
    write_result(args.json_out, result)
    return 0
