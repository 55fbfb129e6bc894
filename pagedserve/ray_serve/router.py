"""``PagedServeRouter``: Ray Serve's request router, scoring replicas the way the gateway does.

Ray's default router probes two random replicas for their queue lengths. This one keeps, per
replica, the gateway's own view (:class:`pagedserve.gateway.pools.Replica`): the engine's load
from the replica's routing stats (``EngineReplica.record_routing_stats``, which Ray collects every
``request_routing_stats_period_s``), corrected between two reports by the requests this router
sent there since; and the gateway's :class:`~pagedserve.gateway.pools.Pool` picks among them: the
least estimated wait, or the replica that served the same prompt prefix before while its wait is
within ``affinity_slack_s`` of the best (its prefix cache is warm).

The prefix key and priority come from the front, as a :class:`RoutingTicket` (the ``routing=``
keyword of ``EngineReplica.forward``), which also tells the router when the answer ended. A
request without one (straight from Ray's HTTP proxy) goes to the least wait, and counts on its
replica until Ray says it completed.
The chosen replica is ranked first and the rest after it by wait, so Ray falls back to them when
the first is at ``max_ongoing_requests``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.gateway.pools import Pool, Replica, ReplicaLoad


class RoutingTicket:
    """One request's routing hints, and the hook by which its front says that its answer ended.

    Ray's completion callback fires once a streamed answer has started, which would count a running
    stream as gone; the front knows when it really ended. The router sees the front's own object
    (the handle routes in the front's process); the replica gets a copy of the hints (pickling drops
    the hook)."""

    def __init__(self, prefix_key: str | None = None, priority: int = 0):
        self.prefix_key = prefix_key
        self.priority = priority
        self._on_end: Callable[[], None] | None = None
        self._ended = False

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix_key": self.prefix_key, "priority": self.priority}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def bind(self, on_end: Callable[[], None]) -> None:
        """The router: call ``on_end`` when the request ends (at once, if it already has)."""
        if self._ended:
            on_end()
        else:
            self._on_end = on_end

    def end(self) -> None:
        """The front: the answer ended, or never started (idempotent)."""
        if not self._ended:
            self._ended = True
            on_end, self._on_end = self._on_end, None
            if on_end is not None:
                on_end()


def routing_hints(pending: PendingRequest | None) -> tuple[str | None, int, Any]:
    """(prefix key, priority, ticket) the front attached to the request, else (None, 0, None)."""
    ticket = pending.kwargs.get("routing") if pending is not None else None
    # Not isinstance: Ray ships the router class by value (cloudpickle), so the router runs its own
    # copy of this module, and the front's tickets belong to the other RoutingTicket class.
    if not all(hasattr(ticket, a) for a in ("prefix_key", "priority", "bind")):
        return None, 0, None
    key, priority = ticket.prefix_key, ticket.priority
    return (key if isinstance(key, str) else None), (priority if isinstance(priority, int) else 0), ticket


class PagedServeRouter(RequestRouter):
    """Least wait with prefix affinity, from the gateway's :class:`Pool` (module docstring)."""

    # Before sending, Ray asks the chosen replica whether it has room (its max_ongoing_requests);
    # an answer later than this counts as "no" and the next-ranked replica is tried. Ray's 0.1 s is
    # missed by an idle replica on a busy host, which would send the request to the loaded one.
    queue_len_response_deadline_s = 0.5
    max_queue_len_response_deadline_s = 2.0

    def initialize_state(self, affinity_slack_s: float = 0.25, default_service_s: float = 2.0,
                         affinity_size: int = 10_000, **_: Any) -> None:
        self.affinity_slack_s = float(affinity_slack_s)
        self.default_service_s = float(default_service_s)
        self._pool = Pool("ray", [], affinity_size=int(affinity_size))
        self._views: dict[str, Replica] = {}  # replica id → the gateway's view of it
        self._stats_seq: dict[str, Any] = {}  # replica id → the sequence number of its last report used
        # internal request id → (replica id, priority, time sent), for the in-flight counts
        self._sent: dict[str, tuple[str, int, float]] = {}
        self._ticketed: set[str] = set()  # requests their front ends (through their RoutingTicket)
        self._loop: asyncio.AbstractEventLoop | None = None  # the router's loop, where the counts change

    def _view(self, replica: RunningReplica) -> Replica:
        rid = replica.replica_id.unique_id
        view = self._views.get(rid)
        if view is None:
            view = self._views[rid] = Replica(rid, healthy=True)
        stats = replica.routing_stats or {}
        seq = stats.get("seq")
        if seq is not None and seq != self._stats_seq.get(rid):
            # A new report: the engine's figures replace ours; what we sent since counts on top.
            self._stats_seq[rid] = seq
            try:
                view.load = ReplicaLoad.from_json(stats)
                view.inflight_at_poll = view.inflight_total
            except (KeyError, TypeError, ValueError):
                view.load = None  # an unreadable report: route on our own in-flight count alone
        return view

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._loop = asyncio.get_running_loop()
        if pending_request is not None:
            # Every candidate is ranked below: when none accepts, Ray should back off, not spin.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        key, priority, _ = routing_hints(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r) for r in candidate_replicas]
        self._pool.replicas = views
        choice = self._pool.choose(priority, key, slack_s=self.affinity_slack_s,
                                   default_service_s=self.default_service_s, candidates=views)
        assert choice is not None  # views is not empty
        best = choice[0]
        rest = sorted((v for v in views if v is not best),
                      key=lambda v: (v.est_wait(priority, self.default_service_s), v.inflight_total))
        return [[by_id[best.url]]] + [[by_id[v.url]] for v in rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        _, priority, ticket = routing_hints(pending_request)
        view = self._views.get(rid)
        if view is None:
            return
        view.started(priority)
        req_id = pending_request.metadata.internal_request_id
        self._sent[req_id] = (rid, priority, time.monotonic())
        if ticket is not None:
            self._ticketed.add(req_id)
            loop = self._loop  # the front ends its ticket on its own loop (another thread)
            ticket.bind(lambda: self._ended(req_id) if loop is None else loop.call_soon_threadsafe(self._ended, req_id))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if internal_request_id not in self._ticketed:  # a ticketed request ends when its ticket does
            self._ended(internal_request_id)

    def _ended(self, internal_request_id: str) -> None:
        self._ticketed.discard(internal_request_id)
        sent = self._sent.pop(internal_request_id, None)
        if sent is None:
            return
        rid, priority, at = sent
        view = self._views.get(rid)
        if view is not None:
            # The time the request held its replica stands in for the service time the gateway
            # measures from the first token (the router never sees the tokens).
            view.ended(priority, time.monotonic() - at)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for rid in [rid for rid in self._views if rid not in live]:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._views.pop(rid, None)
        self._stats_seq.pop(rid, None)
        for req_id in [k for k, v in self._sent.items() if v[0] == rid]:
            del self._sent[req_id]
            self._ticketed.discard(req_id)
