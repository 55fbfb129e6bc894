"""Start a real ``pagedserve serve`` in a subprocess on a free loopback port, for integration tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def run_engine_server(model_dir: str | Path, *extra_args: str, timeout: float = 60) -> Iterator[str]:
    """Start `python -m pagedserve serve` on a free 127.0.0.1 port in a subprocess; yield its base URL
    (e.g. 'http://127.0.0.1:PORT'); terminate it (and wait) on exit.

    The server's output goes to a temporary file, quoted in the error if it fails to start.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            _wait_ready(proc, url, timeout, log)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float, log) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready:\n{_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server at {url} not ready within {timeout:.0f}s:\n{_tail(log)}")


def _tail(log, chars: int = 4000) -> str:  # type: ignore[no-untyped-def]
    log.flush()
    log.seek(0)
    return log.read()[-chars:]
