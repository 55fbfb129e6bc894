"""Pools of engine replicas: background load polling, health, seats, least-wait routing, prefix affinity.

Each replica's load is polled in the background: ``GET /load`` from a pagedserve server, or the
``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` gauges of ``GET /metrics`` from a
vLLM server (``load_source``: auto-detected, or set per pool). A replica that fails a poll or a
forward is taken out of routing and put back when a later poll succeeds (the poll is the probe).
Between polls the gateway corrects the figures with its own count of requests it has sent.

Seats: the gateway forwards a request only while the replica has a seat for it (see
:mod:`pagedserve.gateway.seats`, which queues the rest). For priority ``p`` on a replica of ``S``
seats (``max_num_seqs`` from ``/load``, or the pool's ``seats``)::

    depth    = running + waiting (last poll) + requests sent since − ended since
               (never less than this gateway's own requests in flight there)
    occupied = depth − (this gateway's in-flight requests with priority worse than p)
               (the engine preempts those for p, so they do not hold p's seats)
    free     = S − reserved − occupied      reserved: seats kept for the pool's best tier, 0 for it

:meth:`Replica.est_wait` is the wait a request would see *inside the engine* if it were sent now
(0 while a seat is free; else ``(ahead − S + 1) × seat_s``, stretched by the share of seats held by
better-priority requests, with the engine's own ``est_queue_wait_s`` as a floor for the last in
line). It is what shedding uses for replicas whose seats are unknown (a vLLM server without
``seats``), and what ``/metrics`` reports per replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedserve.gateway.config import PoolConfig

log = logging.getLogger("pagedserve.gateway.pools")


VLLM_RUNNING, VLLM_WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


@dataclass
class ReplicaLoad:
    """The fields of an engine's ``GET /load`` the gateway uses (``max_num_seqs`` None: unknown)."""

    running: int
    waiting: int
    max_num_seqs: int | None
    est_queue_wait_s: float = 0.0
    kv_utilization: float = 0.0
    tokens_per_s: float = 0.0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ReplicaLoad":
        """Parse a ``/load`` body; missing optional figures default to 0. A figure that is not a finite
        number >= 0 raises ValueError: the poll fails and the replica is out of routing (its answers
        feed the wait estimates, where an ``inf`` or ``nan`` would make every comparison meaningless)."""
        return cls(_figure(d["running"], int), _figure(d["waiting"], int), max(1, _figure(d["max_num_seqs"], int)),
                   _figure(d.get("est_queue_wait_s", 0.0)), _figure(d.get("kv_utilization", 0.0)),
                   _figure(d.get("tokens_per_s", 0.0)))

    @classmethod
    def from_vllm_metrics(cls, text: str) -> "ReplicaLoad | None":
        """Running and waiting from vLLM's Prometheus gauges (summed over their label sets), or None
        when the text has neither. vLLM does not export its seat count: that comes from the pool."""
        found: dict[str, float] = {}
        for line in text.splitlines():
            # A sample line: NAME{labels} VALUE [TIMESTAMP]; '#' lines are HELP/TYPE.
            if line.startswith((VLLM_RUNNING, VLLM_WAITING)):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in (VLLM_RUNNING, VLLM_WAITING):
                    value = line.rsplit("}", 1)[-1].split()[0] if "}" in line else line.split()[1]
                    found[name] = found.get(name, 0.0) + float(value)
        if not found:
            return None
        return cls(_figure(found.get(VLLM_RUNNING, 0), int), _figure(found.get(VLLM_WAITING, 0), int), None)


# No replica runs, queues or waits more than this; a larger figure is garbage, not load.
_MAX_FIGURE = 1e9


def _figure(v: Any, kind: type = float) -> Any:
    """``v`` as a number of ``kind`` (``int`` or ``float``) in [0, 1e9], else ValueError (nan included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= _MAX_FIGURE:
        raise ValueError(f"a load figure must be a number from 0 to {_MAX_FIGURE:g}, got {repr(v)[:40]}")
    return kind(v)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else 0.8 * old + 0.2 * new


@dataclass
class Replica:
    """One engine replica as the gateway sees it."""

    url: str
    api_key: str | None = None
    healthy: bool = False
    load: ReplicaLoad | None = None
    load_source: str = "auto"  # configured: auto | pagedserve | vllm | none
    source: str | None = None  # what answered: pagedserve | vllm | none (None until detected)
    seats_override: int | None = None  # the pool's ``seats``: wins over what the load source says
    inflight: Counter[int] = field(default_factory=Counter)  # seats this gateway's requests hold, by priority
    inflight_at_poll: int = 0
    service_s: float | None = None  # moving average of first-token → end seconds (streams)
    hold_s: float | None = None  # moving average of seconds a request holds its seat (sent → end)
    first_byte_s: float | None = None  # moving average of sent → first response byte
    last_error: str = ""
    poll_timeouts: int = 0  # consecutive polls that got no answer in time

    @property
    def inflight_total(self) -> int:
        """Seats this gateway's requests sent here hold (requests not yet ended, × their ``n``)."""
        return sum(self.inflight.values())

    @property
    def seats(self) -> int | None:
        """The replica's seats (max_num_seqs), or None while unknown (no load source says it)."""
        if self.seats_override is not None:
            return self.seats_override
        return self.load.max_num_seqs if self.load is not None else None

    def depth(self) -> int:
        """Requests running or waiting there now, as far as this gateway can tell."""
        if self.load is None:
            return self.inflight_total
        # Our own in-flight requests are a floor: some may not have reached the engine at the last poll.
        return max(self.inflight_total,
                   self.load.running + self.load.waiting + self.inflight_total - self.inflight_at_poll)

    def _worse(self, priority: int) -> int:
        return sum(n for p, n in self.inflight.items() if p > priority)

    def _better(self, priority: int) -> int:
        return sum(n for p, n in self.inflight.items() if p < priority)

    def free_seats(self, priority: int, reserved: int = 0) -> float:
        """Seats a request of ``priority`` may take now (inf while the seat count is unknown).

        Our in-flight requests of worse priority do not count: the engine preempts them for this one.
        ``reserved`` seats are off limits (kept for a better tier)."""
        seats = self.seats
        if seats is None:
            return float("inf")
        return seats - reserved - (self.depth() - self._worse(priority))

    def usable_seats(self, priority: int, reserved: int = 0) -> float:
        """Seats that serve ``priority``'s queue once they free up: its limit, less the seats
        better-priority requests hold beyond the reserve (they use the reserved seats first)."""
        seats = self.seats
        if seats is None:
            return float("inf")
        return max(0, min(seats - reserved, seats - self._better(priority)))

    def est_wait(self, priority: int, default_service_s: float) -> float:
        """Estimated wait inside the engine for a request of ``priority`` sent now (module docstring)."""
        if self.load is None:  # health only: nothing to estimate from
            return 0.0
        load = self.load
        seats = self.seats
        if seats is None:  # vLLM without a configured seat count: saturated iff it has a queue
            if load.waiting == 0:
                return 0.0
            seats = max(1, load.running)
        depth = self.depth()
        if load.est_queue_wait_s > 0 and (load.waiting > 0 or load.running >= seats):
            # The engine measured how fast seats free up: (running + waiting + 1 − seats) / finished_per_s.
            per_seat = load.est_queue_wait_s / max(1, load.running + load.waiting + 1 - seats)
        else:
            per_seat = (self.service_s if self.service_s is not None else default_service_s) / seats
        lower = self._worse(priority)
        better = self._better(priority)
        ahead = max(0, depth - lower)
        est = 0.0 if ahead < seats else (ahead - seats + 1) * per_seat
        # Better-priority traffic keeps arriving and jumping the queue: only the share of seats it
        # leaves free serves this queue (a priority queue's 1 / (1 − ρ_higher) stretch).
        est /= 1.0 - min(0.9, better / seats)
        if lower == 0:  # nobody queued here is behind this request: the engine's own figure applies
            est = max(est, load.est_queue_wait_s)
        return est

    def started(self, priority: int, n: int = 1) -> None:
        """A request taking ``n`` seats was sent here."""
        self.inflight[priority] += n

    def ended(self, priority: int, service_s: float | None, n: int = 1, hold_s: float | None = None) -> None:
        """A request sent here ended; ``service_s`` (first token → end) and ``hold_s`` (sent → end)
        feed the moving averages when the request completed."""
        self.inflight[priority] -= n
        if self.inflight[priority] <= 0:
            del self.inflight[priority]
        if service_s is not None:
            self.service_s = _ewma(self.service_s, service_s)
        if hold_s is not None:
            self.hold_s = _ewma(self.hold_s, hold_s)

    def first_byte(self, seconds: float) -> None:
        """A request's first response byte came ``seconds`` after it was sent here."""
        self.first_byte_s = _ewma(self.first_byte_s, seconds)

    def auth_headers(self) -> dict[str, str]:
        """Headers every request to this replica carries (its API key, if it has one)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class Pool:
    """A named group of replicas; picks the least-wait replica, preferring the prefix's last one."""

    def __init__(self, name: str, replicas: list[Replica], *, affinity_size: int = 10_000,
                 reserved_seats: int = 0, best_priority: int = 0):
        self.name = name
        self.replicas = replicas  # shared with other pools that list the same URL
        self.reserved_seats = reserved_seats  # per replica, kept for best_priority
        self.best_priority = best_priority  # the best priority of the tiers that use this pool
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

    def reserved_for(self, priority: int) -> int:
        """Seats per replica a request of ``priority`` may not take (0 for the pool's best tier)."""
        return self.reserved_seats if priority > self.best_priority else 0

    def choose(self, priority: int, prefix_key: str | None, *, slack_s: float, default_service_s: float,
               candidates: list[Replica] | None = None) -> tuple[Replica, float] | None:
        """The replica with the least estimated wait, or the one that served ``prefix_key`` before
        when its wait is within ``slack_s`` of the best (its prefix cache is warm). None if none is up.
        ``candidates`` restricts the choice (default: every healthy replica)."""
        healthy = self.healthy() if candidates is None else candidates
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


def build_pools(specs: Iterable[PoolConfig]) -> dict[str, Pool]:
    """Pools by name from their configs; the same URL in several pools is one :class:`Replica`
    (polled once, its seats counted once), made from the first pool that lists it: the config
    refuses a URL whose pools disagree on ``api_key``, ``load_source`` or ``seats``."""
    by_url: dict[str, Replica] = {}
    pools = {}
    for spec in specs:
        replicas = [by_url.setdefault(u, Replica(u, spec.api_key, load_source=spec.load_source,
                                                 seats_override=spec.seats)) for u in spec.replicas]
        pools[spec.name] = Pool(spec.name, replicas, reserved_seats=spec.reserved_seats,
                                best_priority=spec.best_priority)
    return pools


class LoadPoller:
    """Polls every replica's load in the background (``/load``, vLLM's ``/metrics`` or ``/health``)."""

    def __init__(self, pools: dict[str, Pool], client: httpx.AsyncClient, interval_s: float,
                 on_poll: Callable[[], None] | None = None, timeouts_before_down: int = 3):
        self.pools = pools
        self.client = client
        self.interval_s = interval_s
        self.timeouts_before_down = timeouts_before_down
        self.on_poll = on_poll  # called after every round: seats may have freed up
        self._task: asyncio.Task[None] | None = None
        self.polls = 0

    def replicas(self) -> list[Replica]:
        """Every distinct replica (a URL listed in two pools is one replica, polled once)."""
        return list({id(r): r for p in self.pools.values() for r in p.replicas}.values())

    async def poll_once(self) -> None:
        """Poll all replicas concurrently and update their health and load."""
        await asyncio.gather(*(self._poll(r) for r in self.replicas()))
        self.polls += 1
        if self.on_poll is not None:
            self.on_poll()

    async def _get(self, r: Replica, path: str) -> httpx.Response:
        return await self.client.get(f"{r.url}{path}", timeout=httpx.Timeout(max(0.5, 4 * self.interval_s)),
                                     headers=r.auth_headers())

    async def _read_load(self, r: Replica) -> ReplicaLoad | None:
        """The replica's load from the first source that answers; None for a health-only replica.

        ``auto`` tries ``/load``, then vLLM's gauges on ``/metrics``, then ``/health``, and keeps
        what answered; a configured source is used alone, and its absence is an error."""
        source = r.source or r.load_source
        if source in ("auto", "pagedserve"):
            resp = await self._get(r, "/load")
            if resp.status_code != 404 or source == "pagedserve":
                resp.raise_for_status()
                load = ReplicaLoad.from_json(resp.json())
                r.source = "pagedserve"
                return load
        if source in ("auto", "vllm"):
            resp = await self._get(r, "/metrics")
            if resp.status_code != 404 or source == "vllm":
                resp.raise_for_status()
                vllm = ReplicaLoad.from_vllm_metrics(resp.text)
                if vllm is not None:
                    r.source = "vllm"
                    return vllm
                if source == "vllm":
                    raise ValueError(f"no {VLLM_RUNNING} / {VLLM_WAITING} gauges on /metrics")
        resp = await self._get(r, "/health")
        resp.raise_for_status()
        if r.source != "none":
            log.info("replica %s reports no load (no /load, no vLLM gauges): routed by this gateway's "
                     "own counts", r.url)
        r.source = "none"
        return None

    async def _poll(self, r: Replica) -> None:
        try:
            at_poll = r.inflight_total
            r.load = await self._read_load(r)
            r.inflight_at_poll = at_poll
            if not r.healthy:
                log.info("replica %s is up: back in routing", r.url)
            r.healthy, r.last_error, r.poll_timeouts = True, "", 0
        except httpx.TimeoutException as e:
            # No answer in time is load as often as death (a replica busy on every core, or this
            # gateway's own loop late): one missed poll taking every replica out of routing turned a
            # busy moment into 503s for all. A refused connection or a 503 is certain, and acts at once.
            r.poll_timeouts += 1
            if r.poll_timeouts >= self.timeouts_before_down:
                self.mark_down(r, f"{r.poll_timeouts} polls in a row unanswered ({type(e).__name__})")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            r.poll_timeouts = 0
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
