"""The gateway's own admission queue: a request is forwarded only while a replica has a seat for it.

Why not let the engine queue? An engine sent more requests than it has seats keeps them in its
own waiting queue, where the gateway can neither shed them when their tier's budget runs out nor
see them except as a count. Queueing here instead:

* the engine's waiting queue stays (nearly) empty: a better-priority request never finds worse
  ones queued in the engine ahead of it, and takes a free seat (or one a worse request holds: the
  engine preempts that one), so its wait does not depend on how much worse traffic is offered;
* ``reserved_seats`` of each replica are kept for the pool's best tier, so worse tiers fill at
  most ``S − reserved_seats`` seats and the best tier usually finds one without preempting;
* a queued request whose tier budget would be exceeded is shed with 429 before any engine work,
  and its reservation refunded: an admitted request has waited at most its budget, by construction;
* the wait of a newcomer is estimated from what the gateway sees — the requests queued ahead of
  it, the seats that serve its queue and how long a seat is held (measured)::

      need = queued ahead (priority ≤ p) + n − free seats now      (≥ 1)
      wait = need × hold_s / usable seats                          hold_s: sent → end, moving average

Waiters are served best priority first, then first come. A request's seat is counted from the
moment it is dispatched until its response ends (``release``), which also wakes the queue, as
does every load poll (other clients' requests may have ended). Replicas whose seat count is
unknown (a vLLM server without the pool's ``seats``) are never queued for here: requests go
straight through and their engine-side wait is estimated from the replica's load instead.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pagedserve.gateway.pools import Pool, Replica


@dataclass
class Seat:
    """A seat on ``replica`` held by one request from dispatch until :meth:`Dispatcher.release`."""

    replica: Replica
    priority: int
    n: int
    sent_at: float  # monotonic time of dispatch
    queued_s: float  # time spent in the gateway's queue (0 when a seat was free on arrival)
    released: bool = False


@dataclass(eq=False)
class _Waiter:
    priority: int
    order: int
    n: int
    tier: str
    prefix_key: str | None
    future: asyncio.Future[Replica] = field(repr=False)

    def __lt__(self, other: "_Waiter") -> bool:
        return (self.priority, self.order) < (other.priority, other.order)


def _finite(seats: float) -> float:
    """A seat count for sums and comparisons: a replica whose seats are unknown (not gated, ``inf``)
    counts as a large finite number, so arithmetic on it stays finite."""
    return min(seats, 1e6)


class Dispatcher:
    """One priority queue per pool; hands out seats on the pool's replicas (see the module docstring)."""

    def __init__(self, pools: dict[str, Pool], *, default_service_s: float, affinity_slack_s: float,
                 check_interval_s: float = 0.5):
        self.pools = pools
        self.default_service_s = default_service_s
        self.affinity_slack_s = affinity_slack_s
        self.check_interval_s = check_interval_s  # how often a waiter checks that its client is still there
        self._queues: dict[str, list[_Waiter]] = {name: [] for name in pools}
        self._order = itertools.count()

    # ---- figures ------------------------------------------------------------------------------

    def queued(self, pool: str) -> Counter[str]:
        """Requests waiting in ``pool``'s queue, by tier."""
        return Counter(w.tier for w in self._queues[pool] if not w.future.done())

    def _ahead(self, pool: Pool, priority: int) -> int:
        """Seats wanted by waiters a newcomer of ``priority`` would queue behind."""
        return sum(w.n for w in self._queues[pool.name] if w.priority <= priority and not w.future.done())

    def hold_s(self, pool: Pool) -> float:
        """Seconds a request holds a seat in ``pool``: the healthy replicas' measured average."""
        measured = [r.hold_s for r in pool.healthy() if r.hold_s is not None]
        return sum(measured) / len(measured) if measured else self.default_service_s

    def first_byte_s(self, pool: Pool) -> float:
        """Seconds from dispatch to the first response byte in ``pool`` (0 until measured): the part
        of a request's wait spent after it leaves the queue."""
        measured = [r.first_byte_s for r in pool.healthy() if r.first_byte_s is not None]
        return sum(measured) / len(measured) if measured else 0.0

    def allowance_s(self, pool: Pool, budget_s: float) -> float:
        """The part of a tier's queue-wait budget a request may spend in ``pool``'s queue: the budget
        less the time from dispatch to the first byte (at most half of it, so that slow prefills
        cannot leave a queued request no time at all). Admission and the queue deadline both use it,
        so a request admitted on its estimate is not shed later for the same wait."""
        return budget_s - min(self.first_byte_s(pool), budget_s / 2)

    def turnover_s(self, pool: Pool, priority: int) -> float:
        """Seconds between two seats that serve ``priority``'s queue freeing up."""
        usable = sum(_finite(r.usable_seats(priority, pool.reserved_for(priority))) for r in pool.healthy())
        return self.hold_s(pool) / max(1.0, usable)

    def _candidates(self, pool: Pool, priority: int, n: int) -> list[Replica]:
        reserved = pool.reserved_for(priority)
        return [r for r in pool.healthy() if r.free_seats(priority, reserved) >= n]

    def capacity(self, pool: Pool, priority: int) -> float | None:
        """The most seats one request of ``priority`` can ever hold on a healthy replica of ``pool``:
        its seats less the reserve (``inf`` where the seat count is unknown: not gated); None when no
        replica is up. A request needing more would wait at the head of the queue, holding back
        everyone behind it, until its budget ran out: it is refused instead (see ``app._route``)."""
        healthy = pool.healthy()
        if not healthy:
            return None
        reserved = pool.reserved_for(priority)
        return max(float("inf") if r.seats is None else float(r.seats - reserved) for r in healthy)

    def estimate(self, pool: Pool, priority: int, n: int = 1) -> float | None:
        """The wait a request of ``priority`` arriving now would see in ``pool`` (None: no replica up)."""
        healthy = pool.healthy()
        if not healthy:
            return None
        ahead = self._ahead(pool, priority)
        if ahead == 0:
            candidates = self._candidates(pool, priority, n)
            if candidates:  # goes at once; what is left is the engine's own queue, if it has one
                return min(r.est_wait(priority, self.default_service_s) for r in candidates)
        reserved = pool.reserved_for(priority)
        free_now = sum(max(0.0, _finite(r.free_seats(priority, reserved))) for r in healthy)
        need = max(1.0, ahead + n - free_now)
        return need * self.turnover_s(pool, priority)

    # ---- seats --------------------------------------------------------------------------------

    def _take(self, pool: Pool, priority: int, n: int, prefix_key: str | None) -> Replica | None:
        """Take ``n`` seats for ``priority`` on the replica :meth:`Pool.choose` prefers among those with
        room (None: none has). The seats count as held at once, so the next pick (later in the same
        :meth:`pump`, or a newcomer's :meth:`acquire`) sees them gone."""
        candidates = self._candidates(pool, priority, n)
        choice = pool.choose(priority, prefix_key, slack_s=self.affinity_slack_s,
                             default_service_s=self.default_service_s, candidates=candidates) if candidates else None
        if choice is None:
            return None
        replica, _ = choice
        replica.started(priority, n)
        return replica

    def peek(self, pool: Pool, priority: int) -> Replica | None:
        """A healthy replica of ``pool`` to ask things of (tokenize) before a seat is taken."""
        healthy = pool.healthy()
        if not healthy:
            return None
        reserved = pool.reserved_for(priority)
        return max(healthy, key=lambda r: _finite(r.free_seats(priority, reserved)))

    async def acquire(self, pool: Pool, priority: int, n: int, tier: str, prefix_key: str | None,
                      deadline: float, gone: Callable[[], Awaitable[bool]] | None = None) -> Seat | str:
        """A seat in ``pool``, at once or after queueing; ``"timeout"`` when ``deadline`` (monotonic)
        passes first, ``"gone"`` when ``gone()`` says the client left while it waited."""
        start = time.monotonic()
        if self._ahead(pool, priority) == 0:
            replica = self._take(pool, priority, n, prefix_key)
            if replica is not None:
                return Seat(replica, priority, n, start, 0.0)
        queue = self._queues[pool.name]
        waiter = _Waiter(priority, next(self._order), n, tier, prefix_key, asyncio.get_running_loop().create_future())
        heapq.heappush(queue, waiter)
        outcome = "timeout"
        try:
            while not waiter.future.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # asyncio.wait leaves the future alone on timeout (wait_for would cancel it).
                await asyncio.wait([waiter.future], timeout=min(left, self.check_interval_s))
                if not waiter.future.done() and gone is not None and await gone():
                    outcome = "gone"
                    break
        except BaseException:  # cancelled while waiting: leave the queue, give back a seat just granted
            self._give_back(queue, waiter)
            raise
        if waiter.future.done() and outcome != "gone":
            now = time.monotonic()
            return Seat(waiter.future.result(), priority, n, now, now - start)
        # Timed out, or the client left (a seat granted while gone() was being asked goes back).
        self._give_back(queue, waiter)
        return outcome

    def _give_back(self, queue: list[_Waiter], waiter: _Waiter) -> None:
        """Take ``waiter`` out of the queue; a seat it was granted meanwhile goes to the next one."""
        self._leave(queue, waiter)
        if waiter.future.done() and not waiter.future.cancelled():
            waiter.future.result().ended(waiter.priority, None, waiter.n)
            self.pump()

    @staticmethod
    def _leave(queue: list[_Waiter], waiter: _Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
        if waiter in queue:
            queue.remove(waiter)
            heapq.heapify(queue)

    def release(self, seat: Seat, service_s: float | None = None, hold_s: float | None = None) -> None:
        """The request holding ``seat`` ended (once; later calls do nothing): free it, wake the queues."""
        if seat.released:
            return
        seat.released = True
        seat.replica.ended(seat.priority, service_s, seat.n, hold_s)
        self.pump()

    def pump(self) -> None:
        """Hand free seats to waiters, best priority first, then first come, in every pool.

        A head that finds no seat stops its queue: a worse waiter behind it has fewer seats to
        choose from, never more, so nobody overtakes (a request for several seats is not starved)."""
        for name, queue in self._queues.items():
            pool = self.pools[name]
            while queue:
                head = queue[0]
                if head.future.done():  # cancelled
                    heapq.heappop(queue)
                    continue
                replica = self._take(pool, head.priority, head.n, head.prefix_key)
                if replica is None:
                    break
                heapq.heappop(queue)
                head.future.set_result(replica)
