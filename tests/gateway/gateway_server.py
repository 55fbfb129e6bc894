"""Run the gateway app on a real loopback port in a background thread (uvicorn), for e2e tests."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import uvicorn

from pagedserve.gateway.app import Gateway, create_app
from pagedserve.gateway.config import GatewayConfig
from pagedserve.gateway.limiter import Limiter
from tests.helpers.servers import free_port


class GatewayThread:
    """``with GatewayThread(config) as gw: gw.url`` — a real HTTP gateway, stopped on exit."""

    def __init__(self, config: GatewayConfig, limiter: Limiter | None = None):
        self.port = free_port()
        self.app = create_app(config, limiter=limiter)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway

    def __enter__(self) -> "GatewayThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
