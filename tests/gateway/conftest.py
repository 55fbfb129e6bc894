"""Fixtures for gateway tests: a real ``redis-server`` on a free loopback port (no persistence), and
two real engine replicas of the ``tiny`` model, which must hold no KV block after each test."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.servers import free_port, run_engine_server, wait_for_idle

MODEL = "tiny"  # the name the engines serve their model under
ENGINE_SEATS = 4

REDIS_BIN = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    """A redis-server child process the tests can kill, restart, freeze (SIGSTOP) and thaw."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING in time")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _running_redis() -> Iterator[RedisServer]:
    if not os.path.exists(REDIS_BIN):
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One Redis for the whole session (tests use distinct bucket keys)."""
    yield from _running_redis()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, for fault tests that kill or freeze it."""
    yield from _running_redis()


@pytest.fixture(scope="session")
def engines(tiny_model_dir: Path) -> Iterator[dict[str, str]]:
    """Two engine replicas started in parallel: one for a provisioned pool, one shared."""
    args = ("--served-model-name", MODEL, "--max-num-seqs", str(ENGINE_SEATS), "--log-level", "warning")
    with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(2) as pool:
        cms = [run_engine_server(tiny_model_dir, *args, timeout=120) for _ in range(2)]
        futures = [pool.submit(cm.__enter__) for cm in cms]
        urls = []
        for cm, f in zip(cms, futures):
            urls.append(f.result())
            stack.push(cm.__exit__)
        yield {"dedicated": urls[0], "shared": urls[1]}


@pytest.fixture(autouse=True)
def _no_leaked_kv_blocks(request: pytest.FixtureRequest, http: httpx.Client) -> Iterator[None]:
    """Every test that sent requests through the engines leaves them with 0 KV blocks used (a leak
    fails the test that caused it, not a later one)."""
    yield
    if "engines" in request.fixturenames:
        for name, url in request.getfixturevalue("engines").items():
            load = wait_for_idle(url, timeout=15.0, http=http)
            assert load["kv_blocks_used"] == 0, f"KV blocks leaked on {name} after {request.node.name}: {load}"
            assert load["running"] == 0 and load["waiting"] == 0, (name, load)
