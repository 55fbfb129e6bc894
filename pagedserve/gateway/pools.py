"""Pools of engine replicas: background load polling, health, least-wait routing, prefix affinity.

Each replica's ``GET /load`` is polled in the background; a replica that fails a poll or a
forward is taken out of routing and put back when a later poll succeeds (the poll is the probe).
Between polls the gateway corrects the figures with its own count of requests it has sent.

Queue-wait estimate for a request of priority ``p`` on one replica (``S`` = ``max_num_seqs``)::

    depth = running + waiting (last poll) + requests sent since the poll − ended since the poll
            (never less than this gateway's own requests in flight there)
    ahead = depth − (this gateway's in-flight requests with priority worse than p)
    wait  = 0                                   while ahead < S (a seat is free or can be taken)
          = (ahead − S + 1) × seat_s            seat_s: seconds between two seats freeing up

divided by (1 − the share of seats held by better-priority requests), because those keep arriving
and jumping the queue. ``seat_s`` comes from the engine when it is saturated (its ``est_queue_wait_s`` is
``(waiting + 1) / finished_per_s``), else from the moving average of observed decode times ÷ S.

The engine serves lower priority values first and lets a waiting request preempt a running one
of strictly worse priority, so a paid request neither queues behind free requests nor waits for
their seats; a free request waits behind everyone (and never less than the engine's own
``est_queue_wait_s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("pagedserve.gateway.pools")


@dataclass
class ReplicaLoad:
    """The fields of an engine's ``GET /load`` the gateway uses."""

    running: int
    waiting: int
    max_num_seqs: int
    est_queue_wait_s: float = 0.0
    kv_utilization: float = 0.0
    tokens_per_s: float = 0.0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReplicaLoad":
        """Parse a ``/load`` body; missing optional figures default to 0."""
        return cls(int(d["running"]), int(d["waiting"]), max(1, int(d["max_num_seqs"])),
                   float(d.get("est_queue_wait_s", 0.0)), float(d.get("kv_utilization", 0.0)),
                   float(d.get("tokens_per_s", 0.0)))


@dataclass
class Replica:
    """One engine replica as the gateway sees it."""

    url: str
    api_key: str | None = None
    healthy: bool = False
    load: ReplicaLoad | None = None
    has_load_endpoint: bool = True
    inflight: Counter[int] = field(default_factory=Counter)  # this gateway's requests by priority
    inflight_at_poll: int = 0
    service_s: float | None = None  # moving average of first-token → end seconds
    last_error: str = ""

    @property
    def inflight_total(self) -> int:
        """Requests this gateway has sent here that have not ended."""
        return sum(self.inflight.values())

    def est_wait(self, priority: int, default_service_s: float) -> float:
        """Estimated queue wait for a new request of ``priority`` (see the module docstring)."""
        if self.load is None:  # no /load (e.g. a plain vLLM server): nothing to estimate from
            return 0.0
        seats = self.load.max_num_seqs
        # Our own in-flight requests are a floor: some may not have reached the engine at the last poll.
        depth = max(self.inflight_total,
                    self.load.running + self.load.waiting + self.inflight_total - self.inflight_at_poll)
        load = self.load
        if load.est_queue_wait_s > 0 and (load.waiting > 0 or load.running >= seats):
            # The engine measured how fast seats free up: (waiting + 1) / finished_per_s.
            per_seat = load.est_queue_wait_s / (load.waiting + 1)
        else:
            per_seat = (self.service_s if self.service_s is not None else default_service_s) / seats
        lower = sum(n for p, n in self.inflight.items() if p > priority)
        better = sum(n for p, n in self.inflight.items() if p < priority)
        ahead = max(0, depth - lower)
        est = 0.0 if ahead < seats else (ahead - seats + 1) * per_seat
        # Better-priority traffic keeps arriving and jumping the queue: only the share of seats it
        # leaves free serves this queue (a priority queue's 1 / (1 − ρ_higher) stretch).
        est /= 1.0 - min(0.9, better / seats)
        if lower == 0:  # nobody queued here is behind this request: the engine's own figure applies
            est = max(est, self.load.est_queue_wait_s)
        return est

    def started(self, priority: int) -> None:
        """A request was sent here."""
        self.inflight[priority] += 1

    def ended(self, priority: int, service_s: float | None) -> None:
        """A request sent here ended; ``service_s`` (first token → end) feeds the moving average."""
        self.inflight[priority] -= 1
        if self.inflight[priority] <= 0:
            del self.inflight[priority]
        if service_s is not None:
            self.service_s = service_s if self.service_s is None else 0.8 * self.service_s + 0.2 * service_s

    def auth_headers(self) -> dict[str, str]:
        """Headers every request to this replica carries (its API key, if it has one)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class Pool:
    """A named group of replicas; picks the least-wait replica, preferring the prefix's last one."""

    def __init__(self, name: str, replicas: list[Replica], *, affinity_size: int = 10_000):
        self.name = name
        self.replicas = replicas  # shared with other pools that list the same URL
        self._affinity: OrderedDict[str, str] = OrderedDict()  # prefix key -> replica url (LRU)
        self._affinity_size = affinity_size
        self._rr = 0

    def healthy(self) -> list[Replica]:
        """Replicas currently in routing."""
        return [r for r in self.replicas if r.healthy]

    def est_wait(self, priority: int, default_service_s: float) -> float:
        """The best queue wait any healthy replica offers (inf when none is healthy)."""
        waits = [r.est_wait(priority, default_service_s) for r in self.healthy()]
        return min(waits) if waits else float("inf")

    def choose(self, priority: int, prefix_key: str | None, *, slack_s: float,
               default_service_s: float) -> tuple[Replica, float] | None:
        """The replica with the least estimated wait, or the one that served ``prefix_key`` before
        when its wait is within ``slack_s`` of the best (its prefix cache is warm). None if none is up."""
        healthy = self.healthy()
        if not healthy:
            return None
        self._rr += 1
        # Ties go round-robin, then to the replica with fewer of our requests in flight.
        order = healthy[self._rr % len(healthy):] + healthy[:self._rr % len(healthy)]
        scored = [(r.est_wait(priority, default_service_s), r.inflight_total, i, r) for i, r in enumerate(order)]
        best_wait, _, _, best = min(scored, key=lambda s: s[:3])
        if prefix_key is not None:
            url = self._affinity.get(prefix_key)
            for wait, _, _, r in scored:
                if r.url == url and wait <= best_wait + slack_s:
                    best, best_wait = r, wait
                    break
            self._affinity[prefix_key] = best.url
            self._affinity.move_to_end(prefix_key)
            if len(self._affinity) > self._affinity_size:
                self._affinity.popitem(last=False)
        return best, best_wait


def prefix_key(body: dict[str, Any], salt: str, chars: int = 512) -> str | None:
    """A hash of the start of the prompt (or of the first messages), scoped by the cache salt."""
    if isinstance(body.get("messages"), list):
        head = repr(body["messages"][:2])[:chars]
    elif "prompt" in body:
        head = repr(body["prompt"])[:chars]
    else:
        return None
    return hashlib.blake2b(f"{salt}\0{head}".encode(), digest_size=12).hexdigest()


def build_pools(spec: dict[str, list[str]], api_keys: dict[str, str | None] | None = None) -> dict[str, Pool]:
    """Pools from ``{name: [url, ...]}``; the same URL in several pools is one :class:`Replica`."""
    by_url: dict[str, Replica] = {}
    keys = api_keys or {}
    return {name: Pool(name, [by_url.setdefault(u, Replica(u, keys.get(name))) for u in urls])
            for name, urls in spec.items()}


class LoadPoller:
    """Polls every replica's ``GET /load`` (or ``GET /health`` where there is none) in the background."""

    def __init__(self, pools: dict[str, Pool], client: httpx.AsyncClient, interval_s: float):
        self.pools = pools
        self.client = client
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self.polls = 0

    def replicas(self) -> list[Replica]:
        """Every distinct replica (a URL listed in two pools is one replica, polled once)."""
        return list({id(r): r for p in self.pools.values() for r in p.replicas}.values())

    async def poll_once(self) -> None:
        """Poll all replicas concurrently and update their health and load."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas()))
        self.polls += 1

    async def _poll(self, r: Replica) -> None:
        timeout = httpx.Timeout(max(0.5, 4 * self.interval_s))
        try:
            at_poll = r.inflight_total
            if r.has_load_endpoint:
                resp = await self.client.get(f"{r.url}/load", timeout=timeout, headers=r.auth_headers())
                if resp.status_code == 404:
                    r.has_load_endpoint = False
            if not r.has_load_endpoint:
                resp = await self.client.get(f"{r.url}/health", timeout=timeout, headers=r.auth_headers())
            resp.raise_for_status()
            r.load = ReplicaLoad.from_json(resp.json()) if r.has_load_endpoint else None
            r.inflight_at_poll = at_poll
            if not r.healthy:
                log.info("replica %s is up: back in routing", r.url)
            r.healthy, r.last_error = True, ""
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            self.mark_down(r, f"{type(e).__name__}: {e}")

    @staticmethod
    def mark_down(r: Replica, reason: str) -> None:
        """Take a replica out of routing until a poll succeeds again."""
        if r.healthy:
            log.warning("replica %s is down (%s): out of routing, probing", r.url, reason)
        r.healthy, r.last_error = False, reason

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # the poller must outlive any one bad answer
                log.exception("load poll failed")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        """Start polling in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gateway-load-poller")

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
