"""Start a real ``pagedserve serve`` in a subprocess on a free loopback port, for integration tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from pagedserve.bench.processes import free_port, running_process

__all__ = ["free_port", "run_engine_server"]


@contextmanager
def run_engine_server(model_dir: str | Path, *extra_args: str, timeout: float = 60,
                      log: IO | None = None) -> Iterator[str]:
    """Start `python -m pagedserve serve` on a free 127.0.0.1 port in a subprocess; yield its base URL
    (e.g. 'http://127.0.0.1:PORT'); terminate it (and wait) on exit.

    The server's output goes to ``log`` (a temporary file when not given), quoted in the error if
    it fails to start.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with running_process(cmd, f"{url}/health", timeout, log=log):
        yield url
