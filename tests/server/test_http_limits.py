"""HTTP limits of the engine server, over real sockets to a real ``pagedserve serve`` on 127.0.0.1:
header size and count (431, 414), head and body read timeouts (408), the idle keep-alive timeout,
the per-request timeout (504, or an error event then ``[DONE]`` in a stream; the engine request
aborted, its KV blocks freed) and HTTP/1.0 streams sent without chunked encoding.

Every socket has a timeout, so a limit that does not hold fails its test instead of hanging it.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest

from pagedserve.server.config import ServerConfig
from tests.helpers.servers import run_paced_engine_server, wait_for_idle

REQUEST_TIMEOUT = 2.0
READ_TIMEOUT = 1.0
KEEP_ALIVE = 1.0
MAX_HEADER_BYTES = 4096
MAX_HEADERS = 20
ARGS = ("--max-model-len", "4096", "--num-kv-blocks", "1024", "--log-level", "warning",
        "--request-timeout", str(REQUEST_TIMEOUT), "--read-timeout", str(READ_TIMEOUT),
        "--keep-alive-timeout", str(KEEP_ALIVE), "--max-header-bytes", str(MAX_HEADER_BYTES),
        "--max-headers", str(MAX_HEADERS))
# Thousands of steps, each paced 3 ms longer than the tiny model's own (tests/helpers/faults.py's
# Paced): longer than REQUEST_TIMEOUT on any CPU (unpaced, a Zen 5 finished all 4,000 within 2 s).
SLOW = {"prompt": "slow", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
STEP_S = 0.003


@pytest.fixture(scope="module")
def url(tiny_model_dir) -> Iterator[str]:  # type: ignore[no-untyped-def]
    with run_paced_engine_server(tiny_model_dir, STEP_S, *ARGS, timeout=300) as u:  # slow to start on a busy machine
        yield u


def _addr(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 80


def exchange(url: str, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``wait`` s)."""
    start = time.monotonic()
    with socket.create_connection(_addr(url), timeout=wait) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before all of it was read: what it answered is still to be read
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pytest.fail(f"the server held the connection for {wait} s; got {out[:300]!r}")
        except ConnectionResetError:
            pass  # closed with our unread bytes in its buffer: the answer came before the reset
    return out, time.monotonic() - start


def split(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def error_of(response: bytes, status: int, code: str) -> dict:
    got, headers, body = split(response)
    assert got == status, response[:500]
    assert headers.get("connection") == "close", headers
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    assert len(err["message"]) > 20, err
    return err


def still_serving(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "alive?", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    load = wait_for_idle(url, timeout=10)
    assert load["kv_blocks_used"] == 0 and load["running"] == 0 and load["waiting"] == 0, load


def test_headers_larger_than_the_limit_get_431(url: str) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 100) + b"\r\n\r\n"
    error_of(exchange(url, request)[0], 431, "headers_too_large")
    # One header line far larger than the limit, still incomplete: refused without waiting for its end.
    out, elapsed = exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Huge: " + b"a" * 1_000_000)
    error_of(out, 431, "headers_too_large")
    assert elapsed < READ_TIMEOUT, elapsed
    still_serving(url)


def test_too_many_headers_get_431(url: str) -> None:
    headers = b"".join(b"X-H%d: 1\r\n" % i for i in range(MAX_HEADERS + 5))
    error_of(exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")[0], 431, "too_many_headers")
    # At the limit is fine.
    ok = b"".join(b"X-H%d: 1\r\n" % i for i in range(MAX_HEADERS - 2))
    out, _ = exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + ok + b"\r\n")
    assert split(out)[0] == 200, out[:300]


def test_url_longer_than_the_limit_gets_414(url: str) -> None:
    out, _ = exchange(url, b"GET /health?q=" + b"a" * (MAX_HEADER_BYTES + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    error_of(out, 414, "url_too_long")


def test_short_body_with_long_content_length_gets_408(url: str) -> None:
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    out, elapsed = exchange(url, request)
    error_of(out, 408, "body_read_timeout")
    assert READ_TIMEOUT * 0.9 <= elapsed < READ_TIMEOUT + 3, elapsed
    still_serving(url)


def test_stalled_request_head_gets_408(url: str) -> None:
    out, elapsed = exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    error_of(out, 408, "header_read_timeout")
    assert elapsed < READ_TIMEOUT + 3, elapsed


@pytest.mark.parametrize("first", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"], ids=["never-used", "after-a-request"])
def test_idle_connection_is_closed_after_the_keep_alive_timeout(url: str, first: bytes) -> None:
    out, elapsed = exchange(url, first)
    if first:
        assert split(out)[0] == 200 and b'"ok"' in out, out[:300]
    assert elapsed < KEEP_ALIVE + 3, elapsed


def test_http10_stream_is_sent_unchunked_and_closed_at_its_end(url: str) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()
    out, _ = exchange(url, b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body) + body)
    status, headers, payload = split(out)  # the read ended: the server closed the connection
    assert status == 200, out[:300]
    assert "transfer-encoding" not in headers, headers
    assert headers["content-type"].startswith("text/event-stream"), headers
    assert int(headers["content-length"]) == len(payload), (headers, len(payload))
    assert headers.get("connection") == "close", headers
    events = [line for line in payload.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 2, events
    # And a plain HTTP/1.0 request is answered as before.
    out, _ = exchange(url, b"GET /health HTTP/1.0\r\n\r\n")
    status, headers, payload = split(out)
    assert status == 200 and int(headers["content-length"]) == len(payload), out


def test_request_past_the_timeout_gets_504_and_is_aborted(url: str) -> None:
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=SLOW, timeout=30)
    elapsed = time.monotonic() - start
    assert r.status_code == 504, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "request_timeout" and err["type"] == "server_error", err
    assert REQUEST_TIMEOUT * 0.9 <= elapsed < REQUEST_TIMEOUT + 5, elapsed
    still_serving(url)  # aborted: no KV block held, nothing running


def test_stream_past_the_timeout_ends_with_an_error_event_then_done(url: str) -> None:
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "request_timeout", err
    assert any('"delta"' in e for e in events[:-2])  # it had streamed tokens before the cut
    still_serving(url)


def test_request_under_the_timeout_is_unaffected(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "quick", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize("field,value", [("request_timeout_s", 0.0), ("request_timeout_s", float("inf")),
                                         ("read_timeout_s", -1.0), ("keep_alive_timeout_s", float("nan")),
                                         ("max_header_bytes", 100), ("max_headers", 1)])
def test_server_config_refuses_bad_limits(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})
