"""``serve --api-server-count 2``: two HTTP front processes on one port feeding one engine core.

One module server (API key, request log) carries the checks that requests spread over both fronts
with the same greedy text as the one-front shared server, that /metrics and /load are engine-wide
whichever front answers, that the dashboard feed and the limits work on both, and that SIGTERM
stops every process with status 0. Two short-lived servers take the faults: the core SIGKILLed
(every stream ends with an error event within a second, exit 1), and, with --restart-engine-core,
the core SIGKILLed (both fronts serve the same text through the new core) then a front SIGKILLed
(exit 1).
No process outlives its server in any case."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pagedserve.bench.processes import free_port, running_process
from pagedserve.server.middleware import API_SERVER_HEADER
from tests.conftest import SHARED_SERVER_ARGS
from tests.helpers.servers import wait_for_idle

KEY = "api-servers-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The fault servers: a small pool (the default would be 1 GiB of KV for the tiny model).
FAULT_ARGS = ("--max-model-len", "1024", "--num-kv-blocks", "512", "--log-level", "warning")


@dataclass
class Fronts:
    url: str
    proc: subprocess.Popen  # type: ignore[type-arg]
    log: Path


def _cmd(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(model_dir), "--api-server-count", "2", *extra]


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_bytes().split(b"\n")[2].lower().find(b"zombie") >= 0
    except OSError:
        return True


def _assert_all_gone(pids: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), f"orphaned processes: {[p for p in pids if not _gone(p)]}"


def _roles(server_pid: int) -> tuple[int, list[int]]:
    """(the core's pid, the fronts' pids): the fronts lead process groups of their own."""
    core, fronts = None, []
    for pid in _children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" not in cmdline:
            continue  # multiprocessing's resource tracker
        if os.getpgid(pid) == pid:
            fronts.append(pid)
        else:
            core = pid
    assert core is not None and len(fronts) == 2, (core, fronts)
    return core, fronts


def _until_both(url: str, path: str = "/health", **kw) -> dict[str, httpx.Response]:  # type: ignore[no-untyped-def]
    """GET ``path`` on fresh connections until both fronts have answered; front index -> response."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(200):
        r = httpx.get(f"{url}{path}", timeout=10, **kw)
        seen.setdefault(r.headers[API_SERVER_HEADER], r)
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only fronts {sorted(seen)} answered")


@pytest.fixture(scope="module")
def fronts(tiny_model_dir) -> Iterator[Fronts]:  # type: ignore[no-untyped-def]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        cmd = _cmd(tiny_model_dir, port, *SHARED_SERVER_ARGS, "--api-key", KEY, "--log-requests",
                   "--log-level", "info")
        with running_process(cmd, f"{url}/health", timeout_s=300, log=log) as proc:
            _until_both(url)  # both have started (they start together; this only confirms it)
            yield Fronts(url, proc, Path(log.name))


def _complete(url: str, i: int, stream: bool) -> tuple[str, str, dict]:
    """One greedy completion on a fresh connection: (answering front, text, usage)."""
    body = {"prompt": f"request number {i} says", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        return r.headers[API_SERVER_HEADER], r.json()["choices"][0]["text"], r.json()["usage"]
    text, usage = "", {}
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        front = r.headers[API_SERVER_HEADER]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return front, text, usage


def _counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE))


def test_requests_spread_over_both_fronts_with_the_one_front_text_and_engine_wide_metrics(fronts, server_url):
    url = fronts.url
    before = httpx.get(f"{url}/metrics", timeout=10).text
    n = 16
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _complete(url, i, stream=i % 2 == 1), range(n)))
    served = {front for front, _, _ in results}
    assert served == {"0", "1"}, f"only fronts {served} served"
    # Greedy: the very text the one-front shared server (same model and engine flags) gives.
    for i, (_, text, _) in enumerate(results):
        single = httpx.post(f"{server_url}/v1/completions", timeout=120, json={
            "prompt": f"request number {i} says", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert text == single.json()["choices"][0]["text"], i
    assert wait_for_idle(url)["kv_blocks_used"] == 0
    # Counters summed over both fronts (or counted by the core) match what the clients saw.
    prompt = sum(u["prompt_tokens"] for _, _, u in results)
    generated = sum(u["completion_tokens"] for _, _, u in results)
    answers = _until_both(url, "/metrics")
    for front, r in answers.items():
        after = r.text
        for name, expected in (("pagedserve_prompt_tokens_total", prompt), ("vllm:prompt_tokens_total", prompt),
                               ("pagedserve_generation_tokens_total", generated),
                               ("vllm:generation_tokens_total", generated),
                               ("vllm:request_success_total", n),
                               ("vllm:e2e_request_latency_seconds_count", n),
                               ("vllm:time_to_first_token_seconds_count", n)):
            assert _counter(after, name) - _counter(before, name) == expected, (front, name)
        assert 'vllm:cache_config_info{block_size="16"' in after and "num_gpu_blocks=\"512\"" in after
    gauges = [{k: v for k, v in r.json().items() if k not in ("tokens_per_s", "est_queue_wait_s")}
              for r in _until_both(url, "/load").values()]
    assert gauges[0] == gauges[1] and gauges[0]["kv_blocks_used"] == 0 and gauges[0]["kv_blocks_total"] == 512
    # Each front logged the requests it served.
    log = fronts.log.read_text(errors="replace")
    for front in ("0", "1"):
        assert re.search(rf"\[api-server {front}\]: request cmpl-\S+ finished: ", log), front


def test_tokens_per_second_is_engine_wide_on_both_fronts(fronts):
    # One keep-alive connection: every request goes to the one front that accepted it.
    with httpx.Client(base_url=fronts.url, headers=AUTH, timeout=120) as http:
        served = set()
        for i in range(3):
            r = http.post("/v1/completions", json={"prompt": f"rate probe {i}", "max_tokens": 16, "ignore_eos": True})
            assert r.status_code == 200, r.text
            served.add(r.headers[API_SERVER_HEADER])
    assert len(served) == 1
    rates = {front: r.json()["tokens_per_s"] for front, r in _until_both(fronts.url, "/load").items()}
    # The other front served nothing in the window, yet reports the core's rate too (read a moment
    # apart, so not to the digit).
    assert min(rates.values()) > 0 and max(rates.values()) <= 2 * min(rates.values()), rates


def test_api_key_limits_and_dashboard_feed_on_both_fronts(fronts):
    url = fronts.url
    refused = _until_both(url, "/v1/models")
    assert all(r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" for r in refused.values())
    too_big = {"prompt": "x" * 300_000, "max_tokens": 1}
    seen = set()
    for _ in range(100):
        r = httpx.post(f"{url}/v1/completions", json=too_big, headers=AUTH, timeout=30)
        assert r.status_code == 413, r.text
        seen.add(r.headers[API_SERVER_HEADER])
        if len(seen) == 2:
            break
    assert seen == {"0", "1"}
    fulls: dict[str, dict] = {}
    for _ in range(100):
        with httpx.stream("GET", f"{url}/dashboard/events", headers=AUTH, timeout=30) as s:
            assert s.status_code == 200
            event = None
            for line in s.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "full":
                    fulls[s.headers[API_SERVER_HEADER]] = json.loads(line[6:])
                    break
        if len(fulls) == 2:
            break
    assert set(fulls) == {"0", "1"}
    assert all(f["num_blocks"] == 512 for f in fulls.values())


def test_sigterm_stops_every_process_with_status_zero(fronts):
    """Last in the module: it stops the module's server."""
    core, front_pids = _roles(fronts.proc.pid)
    children = _children(fronts.proc.pid)
    fronts.proc.terminate()
    assert fronts.proc.wait(timeout=60) == 0
    _assert_all_gone(children)
    assert core in children and set(front_pids) <= set(children)


def _stream_lines(url: str, producing: threading.Semaphore, fronts: list[str]) -> tuple[str, list[str]]:
    """(the answering front, the stream's data lines); at its first token, appends the front to
    ``fronts`` and releases ``producing``."""
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "prompt": "tell me a long story", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1:
                    fronts.append(r.headers[API_SERVER_HEADER])
                    producing.release()
        return r.headers[API_SERVER_HEADER], lines


MAX_STREAMS = 24  # all on one front: 2 in 2^24


def test_killing_the_core_ends_every_stream_on_both_fronts_within_a_second(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = _cmd(tiny_model_dir, port, *FAULT_ARGS)
    with running_process(cmd, f"{url}/health", timeout_s=300) as proc:
        core, _ = _roles(proc.pid)
        children = _children(proc.pid)
        ended: list[float] = []
        fronts: list[str] = []
        producing = threading.Semaphore(0)

        def consume() -> tuple[str, list[str]]:
            result = _stream_lines(url, producing, fronts)
            ended.append(time.monotonic())
            return result
        # The kernel spreads connections over the fronts by a hash of the client's port: six streams
        # all land on one front 1 time in 32. So streams are opened one by one, each producing before
        # the next, until at least six run and both fronts hold some (at most MAX_STREAMS).
        with concurrent.futures.ThreadPoolExecutor(MAX_STREAMS) as pool:
            futures = []
            while len(futures) < 6 or set(fronts) != {"0", "1"}:
                assert len(futures) < MAX_STREAMS, f"{MAX_STREAMS} streams all reached front {fronts[0]}"
                futures.append(pool.submit(consume))
                assert producing.acquire(timeout=60)  # this stream is producing tokens
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=30) for f in futures]
        assert {front for front, _ in results} == {"0", "1"}, "the streams did not reach both fronts"
        for _, lines in results:
            assert lines[-1] == "[DONE]" and '"engine_unavailable"' in lines[-2], lines[-3:]
        assert max(ended) - killed < 1.0
        assert proc.wait(timeout=60) == 1
    _assert_all_gone(children)


def test_restart_engine_core_serves_both_fronts_again_and_a_killed_front_stops_the_server(tiny_model_dir):
    """--restart-engine-core with two fronts: the supervisor replaces a SIGKILLed core and both
    fronts serve the same greedy text through it; then a front's death still ends the server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = _cmd(tiny_model_dir, port, *FAULT_ARGS, "--restart-engine-core")
    with running_process(cmd, f"{url}/health", timeout_s=300) as proc:
        core, front_pids = _roles(proc.pid)
        before = {front: text for front, text, _ in (_complete(url, 0, stream=False) for _ in range(6))}
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while not all(r.status_code == 503 for r in _until_both(url).values()):
            assert time.monotonic() < deadline
        while not all(r.status_code == 200 for r in _until_both(url).values()):
            assert proc.poll() is None and time.monotonic() < deadline, "no new core"
            time.sleep(0.1)
        new_core, fronts_now = _roles(proc.pid)
        assert new_core != core and fronts_now == front_pids and _gone(core)
        after = {}
        while len(after) < 2:
            front, text, _ = _complete(url, 0, stream=False)
            after[front] = text
        assert set(after.values()) == set(before.values()) and len(set(after.values())) == 1
        for r in _until_both(url, "/metrics", headers=AUTH).values():
            assert _counter(r.text, "pagedserve_engine_core_restarts_total") == 1
        idle_by = time.monotonic() + 10  # the engine-wide snapshot, on both fronts
        while not all(r.json()["kv_blocks_used"] == 0 for r in _until_both(url, "/load").values()):
            assert time.monotonic() < idle_by, "KV blocks left in use on the new core"
            time.sleep(0.05)
        children = _children(proc.pid)
        os.kill(front_pids[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    _assert_all_gone(children)


@pytest.mark.parametrize("count", ["0", "17", "two"])
def test_an_api_server_count_out_of_range_is_a_one_line_error(count, capsys):
    from pagedserve.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser("serve").parse_args(["serve", "--api-server-count", count])
    assert exit_info.value.code == 2
    assert f"--api-server-count: must be a whole number from 1 to 16, got {count}" in capsys.readouterr().err
