"""Start a real ``pagedserve serve`` in a subprocess on a free loopback port, for integration tests."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx
import uvicorn

from pagedserve.bench.processes import engine_server, free_port, running_process
from pagedserve.kernels import native_ops

__all__ = ["AppThread", "free_port", "run_engine_server", "run_paced_engine_server", "wait_for_idle"]


@contextmanager
def run_engine_server(model_dir: str | Path, *extra_args: str, timeout: float = 60,
                      log: IO | None = None, port: int | None = None) -> Iterator[str]:
    """Start `python -m pagedserve serve` on a free 127.0.0.1 port in a subprocess; yield its base URL
    (e.g. 'http://127.0.0.1:PORT'); terminate it (and wait) on exit.

    The server's output goes to ``log`` (a temporary file when not given), quoted in the error if
    it fails to start. ``port``: listen there instead of on a free port (to restart a server in place).
    """
    if "--no-native-kernels" not in extra_args:
        # The kernels compile once per machine (over 2 min on a fresh 2-core one with AVX-512), which
        # no server's start timeout covers: built here first, under the build's lock, without one.
        native_ops()
    with engine_server("--model", str(model_dir), *extra_args, log=log, timeout_s=timeout, port=port) as url:
        yield url


@contextmanager
def run_paced_engine_server(model_dir: str | Path, step_s: float, *extra_args: str, timeout: float = 120,
                            port: int | None = None) -> Iterator[str]:
    """As :func:`run_engine_server`, with tests/helpers/faults.py's ``Paced`` core: every model step
    takes ``step_s`` longer, so a long generation that a test needs still running (a held seat, a
    request past its timeout) lasts as long on a fast CPU as on a slow one. ``port``: listen there
    instead of on a free port."""
    native_ops()
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tests.helpers.faults", "paced", str(step_s), "--host", "127.0.0.1", "--port",
           str(port), "--model", str(model_dir), *extra_args]
    with running_process(cmd, f"{url}/health", timeout_s=timeout):
        yield url


def wait_for_idle(url: str, timeout: float = 5.0, http: httpx.Client | None = None) -> dict:
    """Poll an engine's /load until nothing runs or waits and no KV block is used; the last report.
    ``http``: a client to ask with (conftest's ``http``; a new one costs an SSL context)."""
    deadline = time.monotonic() + timeout
    load: dict = {}
    while time.monotonic() < deadline:
        load = (http or httpx).get(f"{url}/load", timeout=5).json()
        if load["running"] == 0 and load["waiting"] == 0 and load["kv_blocks_used"] == 0:
            return load
        time.sleep(0.05)
    return load


class AppThread:
    """``with AppThread(app) as t: t.url`` — an ASGI app served by uvicorn on a free loopback port
    in a background thread, stopped on exit."""

    def __init__(self, app: Any, **uvicorn_kwargs: Any):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **uvicorn_kwargs))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Any:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def core_pid(server_pid: int) -> int:
    """The pid of the engine core process a ``pagedserve serve`` process spawned."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(pid)
    raise AssertionError(f"no engine core among {children}")
