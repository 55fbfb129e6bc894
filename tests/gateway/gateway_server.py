"""Run the gateway app on a real loopback port in a background thread (uvicorn), for e2e tests,
and read its state from outside: bucket levels and metrics."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.gateway.admission import request_bucket, token_bucket
from pagedserve.gateway.app import Gateway, create_app
from pagedserve.gateway.config import GatewayConfig
from pagedserve.gateway.keys import KeyRing
from pagedserve.gateway.limiter import Limiter
from pagedserve.gateway.limiter_redis import RedisLimiter
from tests.helpers.servers import AppThread


class GatewayThread(AppThread):
    """``with GatewayThread(config) as gw: gw.url`` — a real HTTP gateway, stopped on exit."""

    def __init__(self, config: GatewayConfig, limiter: Limiter | None = None):
        self.app = create_app(config, limiter=limiter)
        super().__init__(self.app, lifespan="on")

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway


def bucket_levels(gw: GatewayThread, key: str) -> tuple[float, float | None]:
    """(token bucket, request bucket or None) levels of ``key`` right now, from the gateway's store."""
    g = gw.gateway
    entry = KeyRing(g.config.keys).lookup(key)
    assert entry is not None
    tier = g.config.tiers[entry.tier]
    buckets = [token_bucket(tier, entry), request_bucket(tier, entry)]

    async def peek() -> list[float | None]:
        # Redis: a client of our own, the gateway's is bound to its event loop.
        lim = RedisLimiter(g.limiter.url, timeout_s=2.0) if isinstance(g.limiter, RedisLimiter) else g.limiter
        try:
            return [await lim.peek(b) if b is not None else None for b in buckets]
        finally:
            if lim is not g.limiter:
                await lim.close()  # type: ignore[union-attr]
    tokens, requests = asyncio.run(peek())
    assert tokens is not None
    return tokens, requests


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` with these labels on ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
