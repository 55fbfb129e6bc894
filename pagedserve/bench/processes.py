"""Child processes the benchmarks and tests start: a server on a free loopback port, ready or failed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: IO, chars: int = 4000) -> str:
    log.flush()
    log.seek(0)
    text = log.read()[-chars:]
    return text.decode(errors="replace") if isinstance(text, bytes) else text


@contextmanager
def running_process(cmd: list[str], ready_url: str, timeout_s: float = 300.0,
                    log: IO | None = None) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` until ``ready_url`` answers 200, yield the process, and stop it on exit.

    Output goes to ``log`` (a temporary file when not given); if the process exits or is not
    ready within ``timeout_s``, the error quotes the end of that output.
    """
    own_log = log is None
    out = tempfile.TemporaryFile(mode="w+") if own_log else log
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + timeout_s
        # One client for every probe: each new one builds an SSL context (~30 ms of CPU), ten times a
        # second, taken from the process that is starting.
        with httpx.Client(timeout=1.0, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode} before it was ready:\n"
                                       f"{_tail(out)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not ready within {timeout_s:.0f} s: {' '.join(cmd)}\n{_tail(out)}")
                try:
                    if http.get(ready_url).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if own_log:
            out.close()


@contextmanager
def engine_server(*args: str, log: IO | None = None, timeout_s: float = 300.0,
                  port: int | None = None) -> Iterator[str]:
    """``python -m pagedserve serve ARGS`` on ``port`` (default: a free one) of 127.0.0.1; yields its URL
    once ``/health`` answers, stops it on exit (``log`` as in :func:`running_process`)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with running_process(cmd, f"{url}/health", timeout_s, log=log):
        yield url
