"""The gateway's HTTP app: authenticate, pick a pool, reserve tokens, wait for a seat, forward, reconcile.

One request, in order (each refusal costs no engine work)::

    key → tier ─(401)            body → output cap, priority, cache_salt written in
    pools in the tier's order: more seats than a replica has for the tier, or estimated wait > the
        budget's queue allowance → next pool ─(429 overloaded / 400 sequences_exceed_seats / 503)
    prompt tokens (replica's /tokenize) + seats × cap → buckets ─(429 rate_limit_exceeded / 400 / 503)
        seats = prompts × max(n, best_of): the sequences the replica will run (see shape.py)
    a seat on a replica: at once, or queued in the gateway by priority until one frees up;
        budget spent before that → 429 overloaded, reservation refunded
    forward (stream passed through) → usage → settle the reservation exactly once
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.gateway.admission import Admission, Decision, bucket_views
from pagedserve.gateway.breaker import CircuitBreaker
from pagedserve.gateway.config import GatewayConfig, KeyEntry, TierConfig
from pagedserve.gateway.dashboard import GatewayFeed
from pagedserve.gateway.anthropic import install_anthropic_routes
from pagedserve.gateway.keys import KeyRing, presented_key
from pagedserve.gateway.limiter import Limiter, LimiterUnavailable
from pagedserve.gateway.limiter_memory import MemoryLimiter
from pagedserve.gateway.limiter_redis import RedisLimiter
from pagedserve.gateway.metrics import GatewayMetrics
from pagedserve.gateway.passthrough import relay
from pagedserve.gateway.pools import LoadPoller, Pool, Replica, build_pools, prefix_key
from pagedserve.gateway.responses import error_body, error_response, ratelimit_headers, retry_headers
from pagedserve.gateway.responses_api import install_responses_routes
from pagedserve.gateway.seats import Dispatcher, Seat
from pagedserve.gateway.shape import Shape, read_shape
from pagedserve.gateway.tokens import count_prompt_tokens
from pagedserve.streaming import ClosingStreamingResponse
from pagedserve.web import install_offline_docs, mount_dashboard

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
    dispatcher: Dispatcher
    poller: LoadPoller
    client: httpx.AsyncClient
    metrics: GatewayMetrics


@dataclass
class Route:
    """Where an admitted request goes: its pool, the wait estimated there, the part of the tier's
    budget it may spend queueing there (admission and the queue deadline share this one value),
    and (once taken) its seat."""

    pool: Pool
    est_wait_s: float
    allowance_s: float
    seat: Seat | None = None

    @property
    def replica(self) -> Replica:
        assert self.seat is not None
        return self.seat.replica


def make_limiter(config: GatewayConfig, metrics: GatewayMetrics) -> Limiter:
    """Redis when ``redis_url`` is set, else the in-process buckets."""
    if config.redis_url:
        return RedisLimiter(config.redis_url, timeout_s=config.redis_timeout_s,
                            breaker=CircuitBreaker(3, config.redis_breaker_reset_s),
                            on_error=metrics.limiter_errors.inc)
    return MemoryLimiter()


def create_app(config: GatewayConfig, limiter: Limiter | None = None) -> FastAPI:
    """The gateway app for ``config``; ``limiter`` overrides the one the config implies."""
    app = FastAPI(title="pagedserve gateway", lifespan=_lifespan(config, limiter), docs_url=None, redoc_url=None)
    install_offline_docs(app, "pagedserve gateway")
    mount_dashboard(app, "gateway.html")
    _install_dashboard_feed(app)
    # Registered in this order, which is also the order /docs lists them in.
    _install_generation_routes(app)
    install_anthropic_routes(app, handle, passthrough)
    install_responses_routes(app, handle, config)
    _install_passthrough_routes(app)
    _install_status_routes(app)
    return app


def _lifespan(config: GatewayConfig,
              limiter: Limiter | None) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: build the :class:`Gateway` (``app.state.gateway``) and poll the replicas'
    load from before the first request; on shutdown stop polling and close the clients and stores."""
    metrics = GatewayMetrics()
    pools = build_pools(config.pools.values())
    dispatcher = Dispatcher(pools, default_service_s=config.default_service_s,
                            affinity_slack_s=config.affinity_slack_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256))
        lim = limiter or make_limiter(config, metrics)
        poller = LoadPoller(pools, client, config.load_poll_interval_s, on_poll=dispatcher.pump,
                            timeouts_before_down=config.poll_timeouts_before_down)
        await poller.poll_once()  # route from real figures from the first request on
        poller.start()
        app.state.gateway = Gateway(config, KeyRing(config.keys), lim, Admission(lim, config.redis_breaker_reset_s),
                                    pools, dispatcher, poller, client, metrics)
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
            await app.state.responses.store.close()

    return lifespan


def _install_dashboard_feed(app: FastAPI) -> None:
    """``GET /dashboard/events``, the dashboard's live feed; its :class:`GatewayFeed` is ``app.state.dashboard``."""
    feed = app.state.dashboard = GatewayFeed()

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> Response:
        """The dashboard's live feed: a ``gateway`` server-sent event every half second (docs/DASHBOARD.md)."""
        if feed.full:
            return error_response(503, f"The dashboard already has {feed.max_viewers} viewers; close one.",
                                  code="too_many_viewers")
        events = feed.events(request.app.state.gateway)
        return ClosingStreamingResponse(events, events.aclose, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _install_generation_routes(app: FastAPI) -> None:
    """OpenAI's completions and chat completions, admitted and forwarded by :func:`handle`."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request.app.state.gateway, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request.app.state.gateway, request, "/v1/chat/completions")


def _install_passthrough_routes(app: FastAPI) -> None:
    """The endpoints that generate nothing, passed to a replica by :func:`passthrough`."""

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await passthrough(request.app.state.gateway, request, "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await passthrough(request.app.state.gateway, request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await passthrough(request.app.state.gateway, request, "/detokenize")

    @app.get("/version")
    async def version(request: Request) -> Response:
        return await passthrough(request.app.state.gateway, request, "/version")


def _install_status_routes(app: FastAPI) -> None:
    """The gateway's own ``/health`` and ``/metrics``."""

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
        for name, pool in gw.pools.items():
            for r in pool.replicas:  # the wait the pool's best tier would see there
                m.replica_up.labels(name, r.url).set(1 if r.healthy else 0)
                m.replica_wait.labels(name, r.url).set(r.est_wait(pool.best_priority, gw.config.default_service_s))
            queued = gw.dispatcher.queued(name)
            for tier in gw.config.tiers.values():
                if name in tier.pools:
                    m.queued.labels(tier.name, name).set(queued.get(tier.name, 0))
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


async def passthrough(gw: Gateway, request: Request, path: str) -> Response:
    """Pass an endpoint that generates nothing to a healthy replica of the key's tier (see passthrough.py)."""
    entry = gw.keys.lookup(presented_key(request.headers))
    if entry is None:
        return _unauthorized()
    tier = gw.config.tiers[entry.tier]
    content = await request.body() if request.method == "POST" else None
    answer = await relay(gw.client, _replicas(gw, tier), request.method, path, content,
                         request.headers.get("content-type"))
    if answer is None:
        return error_response(503, "No replica of this tier's pools is up; retry shortly.",
                              code="no_replica_available", headers=retry_headers(1.0))
    return answer


def _replicas(gw: Gateway, tier: TierConfig) -> Iterator[Replica]:
    """The healthy replicas of the tier's pools, in the tier's order; in a pool, the one with the
    most free seats first (as the token count asks), then the others."""
    for name in tier.pools:
        pool = gw.pools[name]
        first = gw.dispatcher.peek(pool, tier.priority)
        if first is None:
            continue
        yield first
        yield from (r for r in pool.healthy() if r is not first)


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


def _prepare(body: dict[str, Any], tier: TierConfig, entry: KeyEntry, path: str) -> Shape | str:
    """Write the output cap, priority and cache salt into ``body``; returns its :class:`Shape` or an error."""
    shape = read_shape(body, path, tier.default_max_tokens)
    if isinstance(shape, str):
        return shape
    body["priority"] = tier.priority  # the tier decides, never the client
    body["cache_salt"] = _cache_salt(tier, entry)
    _apply_stream_interval(tier, body)
    return shape


def _route(gw: Gateway, tier: TierConfig, seats: int) -> Route | tuple[str, float]:
    """The first pool in the tier's order that can seat ``seats`` and whose estimated wait fits the
    budget, or why none did: ``overloaded`` (the least excess), ``no_replica``, or ``too_many_seats``
    (every pool is up and none has a replica with that many seats for this tier: the largest)."""
    over: list[float] = []
    largest: list[float] = []
    down = False
    for name in tier.pools:
        pool = gw.pools[name]
        capacity = gw.dispatcher.capacity(pool, tier.priority)
        if capacity is None:
            down = True
            continue
        if seats > capacity:  # it would never get a seat here, and would hold up the queue trying
            largest.append(capacity)
            continue
        wait = gw.dispatcher.estimate(pool, tier.priority, seats)
        if wait is None:
            down = True
            continue
        allowance = gw.dispatcher.allowance_s(pool, tier.max_queue_wait_s)
        if wait <= allowance:
            return Route(pool, wait, allowance)
        over.append(wait - allowance)
    if over:
        return "overloaded", min(over)
    if down or not largest:  # a pool that is down may be able to seat it when it is back
        return "no_replica", 1.0
    return "too_many_seats", max(largest)


def _log_decision(outcome: str, reason: str, tier: str, key: str, **fields: Any) -> None:
    extra = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    decisions.info("%s reason=%s tier=%s key=%s %s", outcome, reason, tier, key, extra)


@dataclass
class _Ask:
    """A request that passed the first admission checks: its key, the key's tier, the body to
    forward (output cap, priority and cache salt written in) and its shape."""

    entry: KeyEntry
    tier: TierConfig
    body: dict[str, Any]
    shape: Shape


@dataclass
class _Ticket:
    """The tokens reserved for an :class:`_Ask` routed to a pool: the limiter's decision, the prompt's
    counted tokens (and how they were counted), the cost reserved, and the headers to answer with."""

    route: Route
    decision: Decision
    prompt_tokens: int
    counted: str
    cost: int
    headers: dict[str, str]


async def handle(gw: Gateway, request: Request, path: str, translated: dict[str, Any] | None = None) -> Response:
    """Serve one completions or chat completions request (see the module docstring): admission
    (read the ask, route it to a pool, reserve its tokens, take a seat), each refusal costing no
    engine work; then relay and reconcile (:func:`forward`). ``translated``: the chat body another
    API's request became (pagedserve.apis), instead of the request's own."""
    t0 = time.monotonic()
    ask = await _read_ask(gw, request, path, translated)
    if isinstance(ask, Response):
        return ask
    route = _route(gw, ask.tier, ask.shape.seats)
    if not isinstance(route, Route):
        return await _refuse_unroutable(gw, ask, *route)
    # The whole wait before dispatch, the /tokenize call included, fits the time the tier's budget
    # leaves for queueing (see allowance_s). A count cut short by it uses the byte bound; the seat
    # wait then has no time left: a free seat is taken at once, else 429 with a full refund.
    deadline = t0 + route.allowance_s
    ticket = await _reserve_tokens(gw, ask, route, deadline)
    if isinstance(ticket, Response):
        return ticket
    refused = await _take_seat(gw, request, ask, ticket, deadline, t0)
    if refused is not None:
        return refused
    return await forward(gw, ask.tier, route, path, ask.body, ticket.decision, ticket.prompt_tokens,
                         ticket.headers, t0)


async def _read_ask(gw: Gateway, request: Request, path: str,
                    translated: dict[str, Any] | None) -> _Ask | Response:
    """The key's tier and the prepared body, or the 401 / 400 that refuses the request."""
    entry = gw.keys.lookup(presented_key(request.headers))
    if entry is None:
        _log_decision("reject", "unauthorized", "-", "-")
        return _unauthorized()
    tier = gw.config.tiers[entry.tier]
    try:
        body = translated if translated is not None else json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        return error_response(400, "The request body is not valid JSON; send a JSON object.", code="invalid_json")
    if not isinstance(body, dict):
        return error_response(400, "The request body must be a JSON object.", code="invalid_value")
    prepared = _prepare(body, tier, entry, path)
    if isinstance(prepared, str):
        return error_response(400, f"Invalid request: {prepared}.", code="invalid_value")
    return _Ask(entry, tier, body, prepared)


async def _refuse_unroutable(gw: Gateway, ask: _Ask, reason: str, wait: float) -> Response:
    """The answer when :func:`_route` found no pool: 400 (more seats than any replica has for the
    tier; ``wait`` is then that largest), 503 (no replica up) or 429 (every pool over budget)."""
    tier, entry, shape = ask.tier, ask.entry, ask.shape
    gw.metrics.shed.labels(tier.name, tier.pools[0], reason).inc()
    if reason == "too_many_seats":
        _log_decision("reject", reason, tier.name, entry.name, seats=shape.seats, largest=int(wait))
        return error_response(
            400, f"This request runs {shape.seats} sequences at once ({shape.prompts} prompt(s) x "
            f"max(n, best_of) = {shape.per_prompt}), but the replicas of tier '{tier.name}' have at most "
            f"{int(wait)} seats for one request; it can never pass. Send fewer prompts per request or "
            f"lower n / best_of.", code="sequences_exceed_seats", param=shape.seats_param)
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


async def _reserve_tokens(gw: Gateway, ask: _Ask, route: Route, deadline: float) -> _Ticket | Response:
    """Count the prompt's tokens (on the replica that would seat it) and reserve them plus the output
    cap in the tier's buckets; or the 503 / 400 / 429 the limiter's decision refuses the request with."""
    tier, entry = ask.tier, ask.entry
    asked = gw.dispatcher.peek(route.pool, tier.priority)
    assert asked is not None  # _route found a healthy replica in this pool, and nothing awaited since
    prompt_tokens, counted = await count_prompt_tokens(gw.client, asked, ask.body, gw.config.token_count, deadline)
    cost = prompt_tokens + ask.shape.output_tokens
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
    gw.metrics.queue_wait_estimate.labels(tier.name, route.pool.name).observe(route.est_wait_s)
    headers["x-pagedserve-pool"] = route.pool.name
    headers["x-pagedserve-est-queue-wait-ms"] = str(round(route.est_wait_s * 1000))
    return _Ticket(route, decision, prompt_tokens, counted, cost, headers)


async def _take_seat(gw: Gateway, request: Request, ask: _Ask, ticket: _Ticket, deadline: float,
                     t0: float) -> Response | None:
    """Wait for a seat in the ticket's pool until ``deadline`` (the time the tier's budget leaves for
    the queue, see allowance_s) and put it on the route; None once seated, else the 499 (the client
    left) or 429 (no seat in time) to answer, the reservation refunded."""
    tier, entry, shape, route, headers = ask.tier, ask.entry, ask.shape, ticket.route, ticket.headers
    pool = route.pool
    got = await gw.dispatcher.acquire(pool, tier.priority, shape.seats, tier.name,
                                      prefix_key(ask.body, ask.body["cache_salt"]), deadline, request.is_disconnected)
    if not isinstance(got, Seat):
        waited = time.monotonic() - t0
        # Nothing was sent: give back the tokens and the request slot (exactly once).
        await _Settle(gw, tier, route, ticket.decision, ticket.prompt_tokens, t0)("shed", 0.0, no_work=True)
        headers["x-pagedserve-queue-wait-ms"] = str(round(waited * 1000))
        if got == "gone":
            _log_decision("drop", "client_gone_while_queued", tier.name, entry.name, pool=pool.name, waited_s=waited)
            return error_response(499, "The client closed the request while it was queued.", code="client_closed")
        retry = max((gw.dispatcher.estimate(pool, tier.priority, shape.seats) or 0.0) - route.allowance_s,
                    gw.dispatcher.turnover_s(pool, tier.priority))
        gw.metrics.shed.labels(tier.name, pool.name, "queue_timeout").inc()
        _log_decision("shed", "queue_timeout", tier.name, entry.name, pool=pool.name, waited_s=waited,
                      retry_after_s=retry)
        headers |= ratelimit_headers(await bucket_views(gw.limiter, tier, entry))
        return error_response(
            429, f"The service is overloaded for tier '{tier.name}': no seat freed up in pool '{pool.name}' "
            f"within the tier's {tier.max_queue_wait_s:g}s queue-wait budget (waited {waited:.2f}s). "
            f"Please try again in {retry:.2f}s.", code="overloaded", headers=headers | retry_headers(retry))
    route.seat = got
    gw.metrics.admitted.labels(tier.name, pool.name).inc()
    gw.metrics.queue_wait.labels(tier.name, pool.name).observe(got.queued_s)
    headers["x-pagedserve-queue-wait-ms"] = str(round(got.queued_s * 1000))
    _log_decision("admit", ticket.decision.reason, tier.name, entry.name, pool=pool.name, replica=got.replica.url,
                  cost=ticket.cost, seats=shape.seats, prompt_tokens=f"{ticket.prompt_tokens}({ticket.counted})",
                  est_wait_s=route.est_wait_s, queued_s=got.queued_s)
    return None


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
            if self.route.seat is not None and self.streamed:  # a plain response's first byte is its last
                self.route.seat.replica.first_byte(self.first_byte - self.route.seat.sent_at)

    async def __call__(self, outcome: str, actual: float, no_work: bool = False) -> None:
        """Settle with ``actual`` tokens; ``outcome`` labels how the request ended. Later calls do nothing.

        ``no_work``: the request never reached a replica, or the replica refused it (a 5xx) before
        doing any work, so its request-bucket slot is given back too."""
        if self.done:
            return
        self.done = True
        end = time.monotonic()
        seat = self.route.seat
        if seat is not None:
            # Only a completed stream measures decode time (a plain response's first byte is its last).
            measured = self.streamed and self.first_byte is not None and outcome == "usage"
            self.gw.dispatcher.release(seat, end - self.first_byte if measured else None,
                                       end - seat.sent_at if outcome == "usage" else None)
        m = self.gw.metrics
        m.reconciled.labels(self.tier.name, outcome).inc()
        res, req = self.decision.tokens, self.decision.requests
        # Shielded: a client that disconnected cancels the stream, but its refunds must still land.
        # The two refunds are separate calls: losing one must not lose the other.
        with anyio.CancelScope(shield=True):
            if no_work and req is not None:
                try:
                    await req.settle(0)
                except LimiterUnavailable as e:
                    log.warning("refund of a request slot lost: %s", e)
            if res is None:
                return
            try:
                delta = await res.settle(actual)
            except LimiterUnavailable as e:
                log.warning("reconcile of %g tokens lost: %s", res.cost - actual, e)
                return
        m.tokens_used.labels(self.tier.name).inc(actual)
        if delta > 0:
            m.tokens_returned.labels(self.tier.name).inc(delta)


def _apply_stream_interval(tier: TierConfig, body: dict[str, Any]) -> None:
    """A streamed request of a tier with ``stream_interval`` N > 1 asks the replica for one event per
    N tokens; a client asking for coarser keeps its own, and a value that is not a whole number is
    left for the replica to refuse with its 400."""
    if tier.stream_interval <= 1 or not body.get("stream"):
        return
    asked = body.get("stream_interval")
    if asked is None or (type(asked) is int and asked < tier.stream_interval):
        body["stream_interval"] = tier.stream_interval


def _has_usage_object(line: str) -> bool:
    """Whether an SSE data line has ``"usage": {`` (not ``"usage": null``), without decoding it."""
    at = line.find('"usage"')
    while at >= 0:
        rest = line[at + 7:].lstrip()
        if rest.startswith(":") and rest[1:].lstrip().startswith("{"):
            return True
        at = line.find('"usage"', at + 7)
    return False


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _error_code(content: bytes) -> Any:
    """The ``code`` of an OpenAI error body, or None."""
    body = _json_or_none(content.decode(errors="replace"))
    err = body.get("error") if isinstance(body, dict) else None
    return err.get("code") if isinstance(err, dict) else None


def _usage_tokens(usage: Any) -> float | None:
    if isinstance(usage, dict) and "prompt_tokens" in usage:
        return float(usage.get("prompt_tokens") or 0) + float(usage.get("completion_tokens") or 0)
    return None


# Errors raised before the request could have reached a replica.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


async def forward(gw: Gateway, tier: TierConfig, route: Route, path: str, body: dict[str, Any],
                  decision: Decision, prompt_tokens: int, headers: dict[str, str], t0: float) -> Response:
    """Send ``body`` to the chosen replica and pass its answer (streamed or not) back: send it
    (:func:`_send`), relay the answer (:func:`_relay_whole`, or :class:`_SSERelay` through
    :func:`_relay_stream`), and reconcile what the request cost once it is known (``_Settle``)."""
    stream = bool(body.get("stream"))
    client_wants_usage = False
    if stream:
        opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        client_wants_usage = bool(opts.get("include_usage"))
        body["stream_options"] = {**opts, "include_usage": True}  # reconciliation needs the usage chunk
    settle = _Settle(gw, tier, route, decision, prompt_tokens, t0)
    upstream = await _send(gw, route, path, body, settle, prompt_tokens, headers)
    if isinstance(upstream, Response):
        return upstream
    headers = headers | {k: v for k, v in upstream.headers.items()
                         if k.lower() not in _DROP_HEADERS and not k.lower().startswith("x-ratelimit")
                         and k.lower() != "content-type"}
    if not stream or upstream.status_code != 200:
        return await _relay_whole(upstream, route, settle, decision, prompt_tokens, headers)
    settle.streamed = True
    body_iter = _relay_stream(upstream, route, settle, _SSERelay(client_wants_usage), prompt_tokens)

    async def close() -> None:
        await body_iter.aclose()  # if the relay started, its own finally settles with what it counted
        await upstream.aclose()
        await settle("disconnected", float(prompt_tokens))  # it never started: nothing was counted

    return ClosingStreamingResponse(body_iter, close, status_code=200, headers=headers,
                                    media_type="text/event-stream")


async def _send(gw: Gateway, route: Route, path: str, body: dict[str, Any], settle: _Settle, prompt_tokens: int,
                headers: dict[str, str]) -> httpx.Response | Response:
    """The replica's answer, its body not read yet; or the 502 to answer if it could not be had."""
    request = gw.client.build_request("POST", route.replica.url + path, content=json.dumps(body),
                                      headers={"content-type": "application/json", **route.replica.auth_headers()})
    try:
        return await gw.client.send(request, stream=True)
    except httpx.HTTPError as e:
        LoadPoller.mark_down(route.replica, f"{type(e).__name__}: {e}")
        if isinstance(e, _NOT_SENT):  # nothing reached the replica: give back tokens and the request slot
            await settle("failed", 0.0, no_work=True)
            return error_response(502, f"The replica could not be reached ({type(e).__name__}); retry.",
                                  code="replica_unreachable", headers=headers | retry_headers(1.0))
        # Sent, then no answer (a timeout, a crash mid-generation): the replica may have worked on it,
        # so the request slot stays spent and the prompt is charged, as for a client that left.
        await settle("failed", float(prompt_tokens))
        return error_response(502, f"The replica failed before answering ({type(e).__name__}); retry.",
                              code="replica_error", headers=headers | retry_headers(1.0))
    except BaseException:  # cancelled while waiting for the replica: its seat must not stay taken
        with anyio.CancelScope(shield=True):
            await settle("disconnected", float(prompt_tokens))
        raise


async def _relay_whole(upstream: httpx.Response, route: Route, settle: _Settle, decision: Decision,
                       prompt_tokens: int, headers: dict[str, str]) -> Response:
    """A non-streamed answer (or any error answer): read it, settle by its usage, pass it on."""
    media_type = upstream.headers.get("content-type", "application/json")
    try:
        content = await upstream.aread()
        settle.first()
    except httpx.HTTPError as e:  # it answered, then broke off: it took the request, so the prompt is paid
        LoadPoller.mark_down(route.replica, f"failed mid-response: {type(e).__name__}: {e}")
        await settle("failed", float(prompt_tokens))
        return error_response(502, f"The replica failed mid-response ({type(e).__name__}); retry.",
                              code="replica_error", headers=headers | retry_headers(1.0))
    except BaseException:  # cancelled mid-read
        with anyio.CancelScope(shield=True):
            await settle("disconnected", float(prompt_tokens))
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
    if upstream.status_code == 503 and _error_code(content) == "engine_unavailable":
        # Its engine is dead: out of routing now rather than at the next poll (which keeps it out
        # while /load or /health answer 503). A 503 queue-full is load, not death: it stays.
        LoadPoller.mark_down(route.replica, "its engine is unavailable (503 engine_unavailable)")
    actual = None
    if upstream.status_code == 200:
        try:
            actual = _usage_tokens(json.loads(content).get("usage"))
        except (ValueError, AttributeError):
            actual = None
    # An error answer did no generation; a success without usage is charged in full. A 5xx is the
    # replica's failure, not the client's request: its request slot is given back too.
    await settle("usage" if actual is not None else ("failed" if upstream.status_code != 200 else "estimated"),
                 actual if actual is not None else (0.0 if upstream.status_code != 200 else decision.cost),
                 no_work=upstream.status_code >= 500)
    return Response(content, upstream.status_code, headers=headers, media_type=media_type)


class _SSERelay:
    """One streamed answer's relay: passes its SSE lines on, noting usage, errors and [DONE], and
    counting chunks. Only an event that carries a usage object or an error is decoded: decoding
    every token's event was the gateway's main cost per streamed token."""

    def __init__(self, client_wants_usage: bool):
        self.client_wants_usage = client_wants_usage
        self.usage: float | None = None
        self.chunks = 0
        self.done = False  # the replica's own `data: [DONE]` came
        self.errored = False  # the replica sent an error event (the engine ends a failed request so)
        self.at_boundary = True  # what was relayed ends an event (a blank line), or nothing was relayed
        self._skip_blank = False
        self._pending = ""

    def feed(self, text: str) -> bytes:
        """What to send on for a chunk of the replica's text (its complete lines; one write per chunk
        the replica sent, usually one event, not one per line)."""
        self._pending += text
        cut = self._pending.rfind("\n")
        if cut < 0:
            return b""
        data = self._relay(self._pending[:cut].split("\n"))
        self._pending = self._pending[cut + 1:]
        return data

    def flush(self) -> bytes:
        """What is left once the replica's stream ended (a last line without its newline)."""
        return self._relay([self._pending]) if self._pending else b""

    def _relay(self, lines: list[str]) -> bytes:
        out = []
        for line in lines:
            line = line.removesuffix("\r")
            if self._skip_blank and not line:
                self._skip_blank = False
                continue
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    self.done = True
                elif data and '"error"' in line and isinstance(
                        (err := _json_or_none(data)), dict) and isinstance(err.get("error"), dict):
                    self.errored = True  # carries no token: not counted as a chunk
                elif data:
                    event = _json_or_none(data) if _has_usage_object(line) else None
                    u = _usage_tokens(event.get("usage")) if isinstance(event, dict) else None
                    if u is not None:
                        self.usage = u
                        if not event.get("choices"):  # type: ignore[union-attr]
                            if not self.client_wants_usage:
                                self._skip_blank = True  # drop the usage-only event the client did not ask for
                                continue
                        else:
                            self.chunks += 1
                    else:
                        self.chunks += 1
            out.append(line + "\n")
            self.at_boundary = not line
        return "".join(out).encode()

    def outcome(self) -> tuple[str, str | None]:
        """How a stream that ran to its end went, and why it broke off if it did."""
        if self.usage is not None:
            return "usage", None
        if self.done and not self.errored:
            return "estimated", None
        # The replica ended the request with an error, or closed the stream before [DONE].
        return "failed", None if self.done else "the replica closed the stream before its end ([DONE])"

    def tail(self, broke: str | None, replica_url: str) -> bytes | None:
        """Never a silent end: a client must be able to tell a truncated stream from a finished one.
        A stream that got its usage had finished generating (usage comes last) and only lacks
        [DONE]; otherwise an error event, unless the replica sent its own, then [DONE]."""
        if self.done:
            return None
        tail = "" if self.at_boundary else "\n"  # close an event the break left open
        if self.usage is None and not self.errored:
            log.warning("stream from %s ended before [DONE]: %s", replica_url, broke)
            tail += "data: " + json.dumps(error_body(
                f"The response is incomplete: {broke}. Retry the request.", "server_error",
                code="replica_error")) + "\n\n"
        return (tail + "data: [DONE]\n\n").encode()


async def _relay_stream(upstream: httpx.Response, route: Route, settle: _Settle, relay: _SSERelay,
                        prompt_tokens: int) -> AsyncIterator[bytes]:
    """The streamed answer passed on through ``relay``; settled with its usage (or its count of
    chunks) however it ends."""
    outcome, broke = "disconnected", None
    try:
        async for text in upstream.aiter_text():
            settle.first()
            data = relay.feed(text)
            if data:
                yield data
        data = relay.flush()
        if data:
            yield data
        outcome, broke = relay.outcome()
    except httpx.HTTPError as e:
        # A dropped connection (the replica's process died), a read timeout: a half-read line is
        # dropped, and the replica leaves routing until a poll finds it up again.
        outcome = "failed"
        broke = f"the connection to the replica broke ({type(e).__name__})"
        LoadPoller.mark_down(route.replica, f"failed mid-stream: {type(e).__name__}: {e}")
        log.warning("replica %s failed mid-stream: %s", route.replica.url, e)
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        # Usage unknown: the replica took the request (the prompt is paid, as for any request sent
        # and not answered in full) and each chunk it streamed carried at least one token.
        actual = relay.usage if relay.usage is not None else float(prompt_tokens + relay.chunks)
        await settle("usage" if relay.usage is not None else outcome, actual)
    tail = relay.tail(broke, route.replica.url)
    if tail:
        yield tail
