"""``serve --restart-engine-core``: the server replaces an engine core that died, within a budget.

One server (tiny model, small pool, a budget of one restart) takes the whole story: its core is
SIGKILLed under two streams and a plain request (each ends with an error within a second), /health,
/load and new requests answer 503 while the new core loads, then /health is 200 and the official
client gets the same greedy text as before with no KV block left in use; the second SIGKILL is past
the budget, so the server exits with status 1 and leaves no process behind."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.bench.processes import free_port, running_process
from pagedserve.engine.frontend.core_restart import RestartBudget, describe_exit
from tests.helpers.waiting import wait_until
from tests.helpers.servers import core_pid, wait_for_idle

ARGS = ("--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "512", "--log-level", "warning",
        "--restart-engine-core", "--engine-core-max-restarts", "1", "--engine-core-restart-window", "3600")
GREEDY = {"prompt": "the restart test says", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
LONG = {"prompt": "tell me a long story", "max_tokens": 400, "ignore_eos": True}


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("\n")[2].split()[1] == "Z"  # a zombie
    except OSError:
        return True


def _greedy(url: str) -> str:
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        body = {k: v for k, v in GREEDY.items() if k != "ignore_eos"}
        return client.completions.create(model=model, **body, extra_body={"ignore_eos": True}).choices[0].text


def _kill_core_under_load(url: str, pid: int) -> tuple[list[list[str]], httpx.Response, float]:
    """Two streams and one plain request running, then SIGKILL ``pid``: (each stream's data
    lines, the plain request's answer, seconds from the kill to the last of them ending)."""
    streamed: list[list[str]] = []
    ended: list[float] = []
    with httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(3) as pool:
        def stream() -> list[str]:
            lines: list[str] = []
            streamed.append(lines)
            with http.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
            ended.append(time.monotonic())
            return lines

        def plain() -> httpx.Response:
            r = http.post(f"{url}/v1/completions", json=LONG)
            ended.append(time.monotonic())
            return r

        streams = [pool.submit(stream) for _ in range(2)]
        answer = pool.submit(plain)
        # Every request is producing tokens: both streams have tokens and all three are running.
        wait_until(lambda: len(streamed) == 2 and all(len(lines) >= 2 for lines in streamed)
                   and httpx.get(f"{url}/load", timeout=5).json()["running"] == 3,
                   timeout=30, what="three requests producing tokens", interval=0.02)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        results = [s.result(timeout=30) for s in streams]
        response = answer.result(timeout=30)
    return results, response, max(ended) - killed


def test_a_killed_core_is_replaced_once_then_the_server_exits_non_zero(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(tiny_model_dir), *ARGS]
    with tempfile.NamedTemporaryFile("w+") as log, running_process(cmd, f"{url}/health", timeout_s=300,
                                                                   log=log) as proc:
        before = _greedy(url)
        first_core = core_pid(proc.pid)
        streams, plain, took = _kill_core_under_load(url, first_core)
        for lines in streams:
            assert lines[-1] == "[DONE]" and '"engine_unavailable"' in lines[-2], lines[-3:]
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "engine_unavailable", plain.text
        assert took < 1.0, f"the requests ended {took:.2f} s after the kill"

        # While the new core loads: 503s that say to retry, never a hang.
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        assert httpx.get(f"{url}/load", timeout=5).status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=5)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert "restarting" in refused.json()["error"]["message"]
        running = [line for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines()
                   if line.startswith(("pagedserve_num_requests_running{", "pagedserve_kv_blocks_used{"))]
        assert len(running) == 2 and all(line.endswith(" 0.0") for line in running), running

        deadline = time.monotonic() + 300
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "no new core"
            time.sleep(0.1)
        second_core = core_pid(proc.pid)
        assert second_core != first_core and _gone(first_core)
        assert _greedy(url) == before
        assert wait_for_idle(url)["kv_blocks_used"] == 0
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'pagedserve_engine_core_restarts_total{model_name="' in metrics
        assert next(line for line in metrics.splitlines()
                    if line.startswith("pagedserve_engine_core_restarts_total")).endswith(" 1.0")

        # The budget (one restart per hour) is spent: this death is final.
        os.kill(second_core, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        log.seek(0)
        text = log.read()
    assert "died (killed by SIGKILL): failing 3 open requests, starting a new core" in text, text[-3000:]
    assert "engine core restarted in process" in text
    assert "the 1 restarts allowed per 3600 s are spent (--engine-core-max-restarts): giving up" in text
    assert _gone(second_core)


def test_restart_engine_core_without_an_engine_process_is_a_one_line_error(tiny_model_dir, caplog):
    from pagedserve.cli import build_parser
    from pagedserve.server.cli import run_serve

    args = build_parser("serve").parse_args(["serve", "--model", str(tiny_model_dir), "--restart-engine-core",
                                             "--no-engine-process"])
    assert run_serve(args) == 2
    assert "--restart-engine-core needs the engine core in its own process" in caplog.text


def test_the_restart_budget_is_a_sliding_window():
    budget = RestartBudget(max_restarts=2, window_s=60)
    assert budget.take(now=0) and budget.take(now=10)
    assert not budget.take(now=59)  # two within the last 60 s already
    assert budget.take(now=60.5)  # the first has left the window
    assert not budget.take(now=69)
    with pytest.raises(ValueError):
        RestartBudget(max_restarts=0)
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(1) == "exit code 1"


def test_the_restart_flags_are_bounded(capsys):
    from pagedserve.cli import build_parser

    parser = build_parser("serve")
    for flag, value in (("--engine-core-max-restarts", "0"), ("--engine-core-restart-window", "-1")):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["serve", flag, value])
        assert exit_info.value.code == 2
        assert flag in capsys.readouterr().err
    args = parser.parse_args(["serve", "--restart-engine-core"])
    assert (args.restart_engine_core, args.engine_core_max_restarts, args.engine_core_restart_window) == (True, 3, 60)
