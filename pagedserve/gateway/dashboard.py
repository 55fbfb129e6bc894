"""The gateway dashboard's feed: ``GET /dashboard/events``, one ``gateway`` event every half second.

Each event is a snapshot of what the gateway already keeps: per tier, requests admitted, queued
and shed (429/503) by reason, its buckets' levels, and its queue-wait and TTFT histograms; per
pool and replica, health, seats, this gateway's requests in flight, the replica's reported load
and the estimated wait. Counters are cumulative; the page turns them into rates.

One snapshot is built per tick and shared by every viewer (buckets are read from the limiter, a
Redis round trip each, so a tier with per-key buckets shows its first ``MAX_KEYS_SHOWN`` keys).
Like ``/metrics`` it needs no key: it shows key names and levels, never a key.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Histogram

from pagedserve.gateway.admission import request_bucket, token_bucket
from pagedserve.gateway.limiter import LimiterUnavailable
from pagedserve.web import SSE_PREAMBLE, StopCheck, sse_event

if TYPE_CHECKING:
    from pagedserve.gateway.app import Gateway

INTERVAL_S = 0.5
MAX_KEYS_SHOWN = 8
MAX_VIEWERS = 16


def _by_labels(metric: Counter | Histogram, suffix: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called ``<name><suffix>`` of a prometheus metric."""
    out = []
    for family in metric.collect():
        for s in family.samples:
            if s.name == family.name + suffix:
                out.append((s.labels, s.value))
    return out


def _histogram(metric: Histogram, tier: str) -> dict[str, Any]:
    """A tier's histogram summed over pools: upper bounds, cumulative counts, sum and count."""
    cumulative: dict[float, float] = {}
    for labels, value in _by_labels(metric, "_bucket"):
        if labels.get("tier") == tier:
            le = float(labels["le"])
            cumulative[le] = cumulative.get(le, 0.0) + value
    total = sum(v for labels, v in _by_labels(metric, "_sum") if labels.get("tier") == tier)
    bounds = sorted(cumulative)
    return {"le": [b if b != float("inf") else None for b in bounds], "cumulative": [cumulative[b] for b in bounds],
            "sum": total, "count": cumulative.get(float("inf"), 0.0)}


class GatewayFeed:
    """Builds the gateway snapshot (at most once per tick, shared) and streams it to viewers."""

    def __init__(self, max_viewers: int = MAX_VIEWERS):
        self.max_viewers = max_viewers
        self.viewers = 0
        self.should_stop: StopCheck = lambda: False  # the CLI points it at uvicorn's exit flag
        self._cached: tuple[float, bytes] | None = None
        self._building: asyncio.Lock | None = None

    @property
    def full(self) -> bool:
        return self.viewers >= self.max_viewers

    async def snapshot(self, gw: Gateway) -> dict[str, Any]:
        m, cfg = gw.metrics, gw.config
        admitted = _by_labels(m.admitted, "_total")
        shed = _by_labels(m.shed, "_total")
        tiers = []
        for tier in cfg.tiers.values():
            reasons: dict[str, float] = {}
            for labels, v in shed:
                if labels["tier"] == tier.name:
                    reasons[labels["reason"]] = reasons.get(labels["reason"], 0.0) + v
            queued = sum(gw.dispatcher.queued(p).get(tier.name, 0) for p in tier.pools)
            tiers.append({
                "name": tier.name, "priority": tier.priority, "pools": tier.pools,
                "max_queue_wait_s": tier.max_queue_wait_s, "bucket": tier.bucket,
                "admitted": sum(v for labels, v in admitted if labels["tier"] == tier.name),
                "queued": queued, "shed": reasons, "shed_total": sum(reasons.values()),
                "buckets": await self._buckets(gw, tier),
                "queue_wait": _histogram(m.queue_wait, tier.name), "ttft": _histogram(m.ttft, tier.name),
            })
        pools = []
        for name, pool in gw.pools.items():
            queued = gw.dispatcher.queued(name)
            replicas = []
            for r in pool.replicas:
                load = r.load
                replicas.append({
                    "url": r.url, "healthy": r.healthy, "source": r.source, "seats": r.seats,
                    "inflight": r.inflight_total, "running": load.running if load else None,
                    "waiting": load.waiting if load else None,
                    "kv_utilization": load.kv_utilization if load else None,
                    "tokens_per_s": load.tokens_per_s if load else None,
                    "est_wait_s": r.est_wait(pool.best_priority, cfg.default_service_s), "last_error": r.last_error,
                })
            pools.append({"name": name, "provisioned": cfg.provisioned(name), "queued": sum(queued.values()),
                          "est_wait_s": pool.est_wait(pool.best_priority, cfg.default_service_s)
                          if pool.healthy() else None, "replicas": replicas})
        return {"wall_time": time.time(), "limiter": {"kind": type(gw.limiter).__name__, "up": gw.limiter.healthy},
                "tiers": tiers, "pools": pools}

    async def _buckets(self, gw: Gateway, tier: Any) -> list[dict[str, Any]]:
        entries = [k for k in gw.config.keys if k.tier == tier.name]
        if tier.bucket != "key":
            entries = entries[:1]  # one shared bucket: any key of the tier names it
        out = []
        for entry in entries[:MAX_KEYS_SHOWN]:
            for kind, bucket in (("tokens", token_bucket(tier, entry)), ("requests", request_bucket(tier, entry))):
                if bucket is None:
                    continue
                try:
                    level: float | None = await gw.limiter.peek(bucket)
                except LimiterUnavailable:
                    level = None
                out.append({"key": entry.name if tier.bucket == "key" else "(tier)", "kind": kind,
                            "level": level, "burst": bucket.burst, "rate": bucket.rate})
        return out

    async def _event(self, gw: Gateway) -> bytes:
        if self._building is None:
            self._building = asyncio.Lock()
        async with self._building:  # several viewers: one of them builds, the others reuse it
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= INTERVAL_S / 2:
                body = json.dumps(await self.snapshot(gw), separators=(",", ":"))
                self._cached = (now, sse_event("gateway", body))
            return self._cached[1]

    async def events(self, gw: Gateway) -> AsyncIterator[bytes]:
        self.viewers += 1
        try:
            yield SSE_PREAMBLE
            while not self.should_stop():
                yield await self._event(gw)
                await asyncio.sleep(INTERVAL_S)
        finally:
            self.viewers -= 1
