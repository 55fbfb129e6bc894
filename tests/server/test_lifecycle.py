"""A second server with the special flags: no --model with --default-model tiny (the random-weight
test model), --api-key, an inline --chat-template,
a one-seat engine with a one-request waiting queue (503 + Retry-After), and graceful shutdown."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.bench.processes import running_process
from tests.helpers.servers import free_port

KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"


@dataclass
class Guarded:
    url: str
    proc: subprocess.Popen  # type: ignore[type-arg]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def guarded(tiny_model_dir) -> Iterator[Guarded]:  # type: ignore[no-untyped-def]
    """``pagedserve serve --default-model tiny`` without --model (the built-in tiny model, already built
    by tiny_model_dir)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        cmd = [sys.executable, "-m", "pagedserve", "serve", "--port", str(port), "--default-model", "tiny", "--api-key", KEY,
               "--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "1", "--num-kv-blocks", "512",
               "--log-level", "info", "--chat-template", TEMPLATE]
        url = f"http://127.0.0.1:{port}"
        with log.open("w") as out, running_process(cmd, f"{url}/health", 120, log=out) as proc:
            yield Guarded(url, proc, log)


def test_startup_log_and_models_say_random_weights(guarded: Guarded) -> None:
    log = guarded.log_text()
    assert "RANDOM WEIGHTS" in log and "pagedserve serve --model" in log
    assert re.search(r"model: .*dtype \w+", log), log
    assert re.search(r"KV pool: \d+ blocks x \d+ tokens = \d+ tokens, .*seats at max_model_len: \d+", log), log
    assert f"listening on {guarded.url}" in log and "Uvicorn running on" in log
    card = httpx.get(f"{guarded.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    assert card["random_weights"] is True and "--model" in card["description"]


def test_api_key_required_on_v1(guarded: Guarded) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    missing = httpx.post(f"{guarded.url}/v1/completions", json=body, timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(f"{guarded.url}/v1/completions", json=body, timeout=10,
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0) as client:
        r = client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1
    with openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="bad", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    for open_path in ("/health", "/load", "/metrics"):
        assert httpx.get(f"{guarded.url}{open_path}", timeout=10).status_code == 200, open_path


def test_chat_template_flag_replaces_the_tokenizers(guarded: Guarded) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=10) as http:
        chat = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": chat}).json()["prompt"]
        assert text == "<<system>> Be brief.\n<<user>> Hi there\n<<assistant>>"
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(chat), r.text


@pytest.mark.parametrize("value, message", [
    ("{% if %}broken", "does not compile (line 1)"),
    ("{{ messages | no_such_filter }}", "does not compile"),
    ("/no/such/template.jinja", "no such file, and not an inline Jinja template"),
])
def test_broken_chat_template_is_a_one_line_startup_error(value: str, message: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from pagedserve.cli import main

    with caplog.at_level("ERROR", logger="pagedserve.server"):
        assert main(["serve", "--model", "/no/model/needed", "--chat-template", value]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0], errors


def test_full_queue_answers_503_with_retry_after(guarded: Guarded) -> None:
    long = {"prompt": "occupy", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long) as running:  # takes the only seat
            assert running.status_code == 200
            lines = running.iter_lines()  # keep the iterator: dropping it would close the stream
            next(line for line in lines if line.startswith("data: "))
            with http.stream("POST", "/v1/completions", json=long) as waiting:  # fills the queue
                assert waiting.status_code == 200
                load = http.get("/load").json()
                deadline = time.monotonic() + 5
                while load["waiting"] == 0 and time.monotonic() < deadline:  # the snapshot follows the steps
                    time.sleep(0.02)
                    load = http.get("/load").json()
                assert load["running"] == 1 and load["waiting"] == 1, load
                assert load["est_queue_wait_s"] > 0, load  # a newcomer would wait behind both
                refused = http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
                assert refused.status_code == 503, refused.text
                assert int(refused.headers["Retry-After"]) >= 1
                err = refused.json()["error"]
                assert err["type"] == "server_overloaded" and err["code"] == "queue_full"
        # Both hung up: once the server has noticed (within a step), the queue is empty again.
        load = http.get("/load").json()
        deadline = time.monotonic() + 5
        while (load["kv_blocks_used"] or load["waiting"] or load["running"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            load = http.get("/load").json()
        assert load["kv_blocks_used"] == 0 and load["running"] == 0 and load["waiting"] == 0, load
        ok = http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_graceful_shutdown_aborts_in_flight_and_frees_blocks(guarded: Guarded) -> None:
    """Runs last in this module: SIGTERM with a stream in flight."""
    long = {"prompt": "stream until shutdown", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events = 0
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # one iterator throughout: dropping it would close the stream
            try:
                for line in lines:  # the stream must end (drained or cut) after SIGTERM, not hang
                    if line.startswith("data: "):
                        events += 1
                        if events == 3:
                            guarded.proc.send_signal(signal.SIGTERM)
            except httpx.HTTPError:
                pass
    assert events >= 3
    rc = guarded.proc.wait(timeout=30)
    assert rc == 0, f"exit code {rc}:\n{guarded.log_text()[-3000:]}"
    log = guarded.log_text()
    assert "engine stopped: 0 running, 0 waiting, 0 KV blocks in use" in log, log[-3000:]
