"""The gateway's HTTP app: authenticate, pick a pool, reserve tokens, forward, reconcile.

One request, in order (each refusal costs no engine work)::

    key → tier ─(401)            body → output cap, priority, cache_salt written in
    pools in the tier's order: least-wait replica; wait > budget → next pool ─(429 overloaded)
    prompt tokens (replica's /tokenize) + n × cap → buckets ─(429 rate_limit_exceeded / 400 / 503)
    forward (stream passed through) → usage → settle the reservation exactly once
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.gateway.admission import Admission, Decision, bucket_views
from pagedserve.gateway.breaker import CircuitBreaker
from pagedserve.gateway.config import GatewayConfig, KeyEntry, TierConfig
from pagedserve.gateway.keys import KeyRing, bearer_key
from pagedserve.gateway.limiter import Limiter, LimiterUnavailable
from pagedserve.gateway.limiter_memory import MemoryLimiter
from pagedserve.gateway.limiter_redis import RedisLimiter
from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.gateway.pools import LoadPoller, Pool, Replica, build_pools, prefix_key
from pagedserve.gateway.responses import error_response, ratelimit_headers, retry_headers
from pagedserve.gateway.tokens import count_prompt_tokens

log = logging.getLogger("pagedserve.gateway")
decisions = logging.getLogger("pagedserve.gateway.decisions")

# Hop-by-hop and length headers are the transport's business, not the client's.
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding",
                 "date", "server"}


@dataclass
class Gateway:
    """Everything a request handler needs, built once per app (no globals)."""

    config: GatewayConfig
    keys: KeyRing
    limiter: Limiter
    admission: Admission
    pools: dict[str, Pool]
    poller: LoadPoller
    client: httpx.AsyncClient
    metrics: GatewayMetrics


@dataclass
class Route:
    """Where an admitted request goes."""

    pool: Pool
    replica: Replica
    est_wait_s: float


def make_limiter(config: GatewayConfig, metrics: GatewayMetrics) -> Limiter:
    """Redis when ``redis_url`` is set, else the in-process buckets."""
    if config.redis_url:
        return RedisLimiter(config.redis_url, timeout_s=config.redis_timeout_s,
                            breaker=CircuitBreaker(3, config.redis_breaker_reset_s),
                            on_error=metrics.limiter_errors.inc)
    return MemoryLimiter()


def create_app(config: GatewayConfig, limiter: Limiter | None = None) -> FastAPI:
    """The gateway app for ``config``; ``limiter`` overrides the one the config implies."""
    metrics = GatewayMetrics()
    pools = build_pools({name: p.replicas for name, p in config.pools.items()},
                        {name: p.api_key for name, p in config.pools.items()})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256))
        lim = limiter or make_limiter(config, metrics)
        poller = LoadPoller(pools, client, config.load_poll_interval_s)
        await poller.poll_once()  # route from real figures from the first request on
        poller.start()
        app.state.gateway = Gateway(config, KeyRing(config.keys), lim, Admission(lim, config.redis_breaker_reset_s),
                                    pools, poller, client, metrics)
        kinds = ", ".join(f"{name} ({'provisioned' if config.provisioned(name) else 'shared'}: "
                          f"{len(pool.healthy())}/{len(pool.replicas)} up)" for name, pool in pools.items())
        log.info("gateway ready: pools %s; %d tiers, %d keys, limiter %s", kinds, len(config.tiers),
                 len(config.keys), type(lim).__name__)
        try:
            yield
        finally:
            await poller.stop()
            await client.aclose()
            await lim.close()

    app = FastAPI(title="pagedserve gateway", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request.app.state.gateway, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request.app.state.gateway, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        entry = gw.keys.lookup(bearer_key(request.headers.get("authorization")))
        if entry is None:
            return _unauthorized()
        for name in gw.config.tiers[entry.tier].pools:
            for r in gw.pools[name].healthy():
                try:
                    resp = await gw.client.get(f"{r.url}/v1/models", headers=r.auth_headers())
                    return Response(resp.content, resp.status_code, media_type="application/json")
                except httpx.HTTPError as e:
                    LoadPoller.mark_down(r, f"{type(e).__name__}: {e}")
        return error_response(503, "No replica of this tier's pools is up.", code="no_replica_available")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        gw: Gateway = request.app.state.gateway
        return JSONResponse({"status": "ok", "limiter_up": gw.limiter.healthy,
                             "pools": {n: {"healthy": len(p.healthy()), "replicas": len(p.replicas)}
                                       for n, p in gw.pools.items()}})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        m = gw.metrics
        m.limiter_up.set(1 if gw.limiter.healthy else 0)
        best = min((t.priority for t in gw.config.tiers.values()), default=0)
        for name, pool in gw.pools.items():
            for r in pool.replicas:
                m.replica_up.labels(name, r.url).set(1 if r.healthy else 0)
                m.replica_wait.labels(name, r.url).set(r.est_wait(best, gw.config.default_service_s))
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _unauthorized() -> JSONResponse:
    return error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with a key "
                          "this gateway knows.", code="invalid_api_key")


def _cache_salt(tier: TierConfig, entry: KeyEntry) -> str:
    """Prefix-cache namespace: per key (default), per tier, or one shared by everyone."""
    if tier.cache_salt == "key":
        return "key:" + entry.digest.hex()[:32]
    if tier.cache_salt == "tier":
        return "tier:" + tier.name
    return "shared"


def _prepare(body: dict[str, Any], tier: TierConfig, entry: KeyEntry, path: str) -> tuple[int, int] | str:
    """Write the output cap, priority and cache salt into ``body``; returns ``(cap, n)`` or an error."""
    caps = []
    for f in ("max_tokens", "max_completion_tokens"):
        v = body.get(f)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"'{f}' must be an integer >= 1"
        caps.append(v)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return "'n' must be an integer >= 1"
    if not caps:  # an uncapped request would reserve nothing sensible: give it the tier's cap
        body["max_tokens" if path == "/v1/completions" else "max_completion_tokens"] = tier.default_max_tokens
        caps.append(tier.default_max_tokens)
    body["priority"] = tier.priority  # the tier decides, never the client
    body["cache_salt"] = _cache_salt(tier, entry)
    return max(caps), n


def _route(gw: Gateway, tier: TierConfig, pkey: str | None) -> Route | tuple[str, float]:
    """The first pool in the tier's order whose best replica fits the wait budget, or why none did."""
    over: list[float] = []
    for name in tier.pools:
        pool = gw.pools[name]
        choice = pool.choose(tier.priority, pkey, slack_s=gw.config.affinity_slack_s,
                             default_service_s=gw.config.default_service_s)
        if choice is None:
            continue
        replica, wait = choice
        if wait <= tier.max_queue_wait_s:
            return Route(pool, replica, wait)
        over.append(wait - tier.max_queue_wait_s)
    if not over:
        return "no_replica", 1.0
    return "overloaded", min(over)


def _log_decision(outcome: str, reason: str, tier: str, key: str, **fields: Any) -> None:
    extra = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    decisions.info("%s reason=%s tier=%s key=%s %s", outcome, reason, tier, key, extra)


async def handle(gw: Gateway, request: Request, path: str) -> Response:
    """Serve one completions or chat completions request (see the module docstring)."""
    t0 = time.monotonic()
    entry = gw.keys.lookup(bearer_key(request.headers.get("authorization")))
    if entry is None:
        _log_decision("reject", "unauthorized", "-", "-")
        return _unauthorized()
    tier = gw.config.tiers[entry.tier]
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        return error_response(400, "The request body is not valid JSON; send a JSON object.", code="invalid_json")
    if not isinstance(body, dict):
        return error_response(400, "The request body must be a JSON object.", code="invalid_value")
    prepared = _prepare(body, tier, entry, path)
    if isinstance(prepared, str):
        return error_response(400, f"Invalid request: {prepared}.", code="invalid_value")
    cap, n = prepared

    route = _route(gw, tier, prefix_key(body, body["cache_salt"]))
    if not isinstance(route, Route):
        reason, wait = route
        first = tier.pools[0]
        gw.metrics.shed.labels(tier.name, first, reason).inc()
        if reason == "no_replica":
            _log_decision("shed", reason, tier.name, entry.name, pools=",".join(tier.pools))
            return error_response(503, "No replica of this tier's pools is up; retry shortly.",
                                  code="no_replica_available", headers=retry_headers(wait))
        _log_decision("shed", reason, tier.name, entry.name, pools=",".join(tier.pools), over_budget_s=wait)
        headers = ratelimit_headers(await bucket_views(gw.limiter, tier, entry))
        return error_response(
            429, f"The service is overloaded for tier '{tier.name}': the estimated queue wait exceeds its "
            f"{tier.max_queue_wait_s:g}s budget in every pool it may use. Please try again in {wait:.2f}s.",
            code="overloaded", headers=headers | retry_headers(wait))

    prompt_tokens, counted = await count_prompt_tokens(gw.client, route.replica, body, gw.config.token_count)
    cost = prompt_tokens + n * cap
    decision = await gw.admission.admit(tier, entry, cost)
    headers = ratelimit_headers(decision)
    if not decision.admitted:
        if decision.reason == "limiter_unavailable":
            gw.metrics.shed.labels(tier.name, route.pool.name, decision.reason).inc()
            _log_decision("shed", decision.reason, tier.name, entry.name, cost=cost)
            return error_response(503, decision.message, code="rate_limiter_unavailable",
                                  headers=headers | retry_headers(decision.retry_after_s))
        gw.metrics.shed.labels(tier.name, route.pool.name, decision.reason).inc()
        _log_decision("shed", decision.reason, tier.name, entry.name, cost=cost,
                      retry_after_s=decision.retry_after_s if decision.reason != "too_large" else "never")
        if decision.reason == "too_large":
            return error_response(400, decision.message, code="tokens_exceed_bucket", param="max_tokens",
                                  headers=headers)
        return error_response(429, decision.message, code="rate_limit_exceeded",
                              headers=headers | retry_headers(decision.retry_after_s))
    if decision.reason == "admitted_limiter_down":
        gw.metrics.limiter_fail_open.labels(tier.name).inc()
    else:
        gw.metrics.tokens_reserved.labels(tier.name).inc(cost)
    gw.metrics.admitted.labels(tier.name, route.pool.name).inc()
    gw.metrics.queue_wait.labels(tier.name, route.pool.name).observe(route.est_wait_s)
    _log_decision("admit", decision.reason, tier.name, entry.name, pool=route.pool.name, replica=route.replica.url,
                  cost=cost, prompt_tokens=f"{prompt_tokens}({counted})", est_wait_s=route.est_wait_s)
    headers["x-pagedserve-pool"] = route.pool.name
    headers["x-pagedserve-est-queue-wait-ms"] = str(round(route.est_wait_s * 1000))
    return await forward(gw, tier, route, path, body, decision, prompt_tokens, headers, t0)


class _Settle:
    """Ends one forwarded request exactly once: replica bookkeeping, metrics and the refund."""

    def __init__(self, gw: Gateway, tier: TierConfig, route: Route, decision: Decision, prompt_tokens: int, t0: float):
        self.gw, self.tier, self.route, self.decision = gw, tier, route, decision
        self.prompt_tokens, self.t0 = prompt_tokens, t0
        self.first_byte: float | None = None
        self.streamed = False
        self.done = False

    def first(self) -> None:
        """The replica's first byte arrived (records TTFT once)."""
        if self.first_byte is None:
            self.first_byte = time.monotonic()
            self.gw.metrics.ttft.labels(self.tier.name, self.route.pool.name).observe(self.first_byte - self.t0)

    async def __call__(self, outcome: str, actual: float) -> None:
        """Settle with ``actual`` tokens; ``outcome`` labels how the request ended. Later calls do nothing."""
        if self.done:
            return
        self.done = True
        end = time.monotonic()
        # Only a completed stream measures decode time (a plain response's first byte is its last).
        measured = self.streamed and self.first_byte is not None and outcome == "usage"
        self.route.replica.ended(self.tier.priority, end - self.first_byte if measured else None)
        res = self.decision.tokens
        m = self.gw.metrics
        m.reconciled.labels(self.tier.name, outcome).inc()
        if res is None:
            return
        try:
            # Shielded: a client that disconnected cancels the stream, but its refund must still land.
            with anyio.CancelScope(shield=True):
                delta = await res.settle(actual)
        except LimiterUnavailable as e:
            log.warning("reconcile of %d tokens lost: %s", res.cost - actual, e)
            return
        m.tokens_used.labels(self.tier.name).inc(actual)
        if delta > 0:
            m.tokens_returned.labels(self.tier.name).inc(delta)


def _usage_tokens(usage: Any) -> float | None:
    if isinstance(usage, dict) and "prompt_tokens" in usage:
        return float(usage.get("prompt_tokens") or 0) + float(usage.get("completion_tokens") or 0)
    return None


async def forward(gw: Gateway, tier: TierConfig, route: Route, path: str, body: dict[str, Any],
                  decision: Decision, prompt_tokens: int, headers: dict[str, str], t0: float) -> Response:
    """Send ``body`` to the chosen replica and pass its answer (streamed or not) back."""
    stream = bool(body.get("stream"))
    client_wants_usage = False
    if stream:
        opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        client_wants_usage = bool(opts.get("include_usage"))
        body["stream_options"] = {**opts, "include_usage": True}  # reconciliation needs the usage chunk
    settle = _Settle(gw, tier, route, decision, prompt_tokens, t0)
    route.replica.started(tier.priority)
    request = gw.client.build_request("POST", route.replica.url + path, content=json.dumps(body),
                                      headers={"content-type": "application/json", **route.replica.auth_headers()})
    try:
        upstream = await gw.client.send(request, stream=True)
    except httpx.HTTPError as e:
        LoadPoller.mark_down(route.replica, f"{type(e).__name__}: {e}")
        await settle("failed", 0.0)
        return error_response(502, f"The replica could not be reached ({type(e).__name__}); retry.",
                              code="replica_unreachable", headers=headers | retry_headers(1.0))
    headers = headers | {k: v for k, v in upstream.headers.items()
                         if k.lower() not in _DROP_HEADERS and not k.lower().startswith("x-ratelimit")
                         and k.lower() != "content-type"}
    media_type = upstream.headers.get("content-type", "application/json")

    if not stream or upstream.status_code != 200:
        try:
            content = await upstream.aread()
            settle.first()
        except httpx.HTTPError as e:
            await settle("failed", 0.0)
            return error_response(502, f"The replica failed mid-response ({type(e).__name__}).",
                                  code="replica_error", headers=headers)
        finally:
            await upstream.aclose()
        actual = None
        if upstream.status_code == 200:
            try:
                actual = _usage_tokens(json.loads(content).get("usage"))
            except (ValueError, AttributeError):
                actual = None
        # An error answer did no generation; a success without usage is charged in full.
        await settle("usage" if actual is not None else ("failed" if upstream.status_code != 200 else "estimated"),
                     actual if actual is not None else (0.0 if upstream.status_code != 200 else decision.cost))
        return Response(content, upstream.status_code, headers=headers, media_type=media_type)

    settle.streamed = True

    async def passthrough() -> AsyncIterator[bytes]:
        usage: float | None = None
        chunks = 0
        outcome = "disconnected"
        skip_blank = False
        try:
            async for line in upstream.aiter_lines():
                settle.first()
                if skip_blank and not line:
                    skip_blank = False
                    continue
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    try:
                        event = json.loads(line[5:])
                    except ValueError:
                        event = None
                    if isinstance(event, dict):
                        u = _usage_tokens(event.get("usage"))
                        if u is not None:
                            usage = u
                            if not client_wants_usage and not event.get("choices"):
                                skip_blank = True  # drop the usage-only event the client did not ask for
                                continue
                        if event.get("choices"):
                            chunks += 1
                yield (line + "\n").encode()
            outcome = "usage" if usage is not None else "estimated"
        except httpx.HTTPError as e:
            outcome = "failed"
            log.warning("replica %s failed mid-stream: %s", route.replica.url, e)
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
            if usage is not None:
                actual = usage
            elif chunks == 0 and outcome == "failed":
                actual = 0.0
            else:  # usage unknown after output began: each chunk carried at least one token
                actual = float(prompt_tokens + chunks)
            await settle("usage" if usage is not None else outcome, actual)

    return StreamingResponse(passthrough(), status_code=200, headers=headers, media_type="text/event-stream")

