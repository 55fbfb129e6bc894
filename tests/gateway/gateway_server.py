"""Run the gateway app on a real loopback port in a background thread (uvicorn), for e2e tests."""

from __future__ import annotations

from pagedserve.gateway.app import Gateway, create_app
from pagedserve.gateway.config import GatewayConfig
from pagedserve.gateway.limiter import Limiter
from tests.helpers.servers import AppThread


class GatewayThread(AppThread):
    """``with GatewayThread(config) as gw: gw.url`` — a real HTTP gateway, stopped on exit."""

    def __init__(self, config: GatewayConfig, limiter: Limiter | None = None):
        self.app = create_app(config, limiter=limiter)
        super().__init__(self.app, lifespan="on")

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway
