"""Queueing formulas for a pool of servers: M/M/1, M/M/c (Erlang C), M/G/1, priority tiers, shedding.

A *server* is one seat that serves one request at a time (a replica slot, a batch lane); the
*service time* is how long a request holds it. Waits are time in queue, before service starts —
the part a gateway can shed. Every function answers ``inf`` when the queue is unstable
(utilization ≥ 1) instead of a misleading finite number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# The tail the SLO is on, unless a caller asks for another.
DEFAULT_PERCENTILE = 0.95


class QueueingError(ValueError):
    """Inputs to a queueing formula that make no sense."""


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability an arrival waits in an M/M/c queue (Erlang C); 1.0 when the queue is unstable.

    ``offered_load`` is λ × mean service time (in Erlangs). Computed through the Erlang B
    recursion, which stays exact for thousands of servers where factorials would overflow.
    """
    if servers < 1:
        raise QueueingError(f"servers must be >= 1, got {servers}")
    if offered_load < 0:
        raise QueueingError(f"offered load must be >= 0, got {offered_load}")
    if offered_load >= servers:
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    return servers * blocking / (servers - offered_load * (1.0 - blocking))


@dataclass(frozen=True)
class QueueResult:
    """One pool's steady state: how busy it is and how long arrivals wait before service."""

    arrival_rate: float
    service_time: float
    servers: int
    utilization: float
    p_wait: float
    mean_wait: float
    percentile: float
    percentile_wait: float

    @property
    def stable(self) -> bool:
        """True when utilization < 1, so waits are finite."""
        return self.utilization < 1.0

    @property
    def mean_response(self) -> float:
        """Mean wait plus mean service time."""
        return self.mean_wait + self.service_time


def mmc(arrival_rate: float, service_time: float, servers: int = 1,
        percentile: float = DEFAULT_PERCENTILE) -> QueueResult:
    """An M/M/c pool: Poisson arrivals, exponential service, ``servers`` seats, first come first served.

    Mean wait is ``C / (cμ − λ)``; the wait is 0 with probability ``1 − C`` and otherwise
    exponential with rate ``cμ − λ``, so its ``percentile`` is ``ln(C / (1 − q)) / (cμ − λ)``
    (0 when fewer than ``1 − q`` of arrivals wait at all).
    """
    _check(arrival_rate=arrival_rate, service_time=service_time, percentile=percentile)
    mu = 1.0 / service_time
    load = arrival_rate * service_time
    utilization = load / servers
    p_wait = erlang_c(servers, load)
    if utilization >= 1.0:
        return QueueResult(arrival_rate, service_time, servers, utilization, 1.0, math.inf, percentile, math.inf)
    drain = servers * mu - arrival_rate
    tail = 1.0 - percentile
    pct_wait = math.log(p_wait / tail) / drain if p_wait > tail else 0.0
    return QueueResult(arrival_rate, service_time, servers, utilization, p_wait, p_wait / drain, percentile, pct_wait)


def mm1(arrival_rate: float, service_time: float, percentile: float = DEFAULT_PERCENTILE) -> QueueResult:
    """An M/M/1 pool: mean wait ``ρ S / (1 − ρ)``, where ρ = λ S."""
    return mmc(arrival_rate, service_time, 1, percentile)


def mg1(arrival_rate: float, service_time: float, service_cv: float,
        percentile: float = DEFAULT_PERCENTILE) -> QueueResult:
    """An M/G/1 pool whose service times have coefficient of variation ``service_cv`` (std ÷ mean).

    The mean wait is Pollaczek–Khinchine's ``ρ S (1 + cv²) / (2 (1 − ρ))``: exact for any service
    distribution. The percentile is an approximation — P(wait > t) ≈ ρ·exp(−ρ t / W̄), the
    exponential tail with the right mass and mean, exact only at cv = 1 (M/M/1); use
    ``pagedserve simulate`` for the tail of other distributions.
    """
    _check(arrival_rate=arrival_rate, service_time=service_time, percentile=percentile)
    if service_cv < 0:
        raise QueueingError(f"service cv must be >= 0, got {service_cv}")
    rho = arrival_rate * service_time
    if rho >= 1.0:
        return QueueResult(arrival_rate, service_time, 1, rho, 1.0, math.inf, percentile, math.inf)
    mean_wait = rho * service_time * (1.0 + service_cv**2) / (2.0 * (1.0 - rho))
    tail = 1.0 - percentile
    pct_wait = math.log(rho / tail) * mean_wait / rho if rho > tail and mean_wait > 0 else 0.0
    return QueueResult(arrival_rate, service_time, 1, rho, rho, mean_wait, percentile, pct_wait)


def priority_waits(arrival_rates: Sequence[float], service_time: float, servers: int = 1,
                   service_cv: float = 1.0) -> list[float]:
    """Mean waits of tiers served by non-preemptive priority (first rate = highest priority).

    Cobham's formula: tier k waits ``W0 / ((1 − σ_{k−1})(1 − σ_k))`` where σ_k is the load of
    tiers 1..k and W0 the mean residual work found in service. For one server W0 = λ E[S²] / 2
    (any service distribution); for c servers it is ``C / (c μ)`` and needs exponential service
    with one mean for all tiers (cv = 1). A tier whose cumulative load reaches 1 waits forever,
    while the tiers above it stay bounded — the point of giving paid traffic priority.
    """
    _check(service_time=service_time)
    if any(rate < 0 for rate in arrival_rates) or not arrival_rates:
        raise QueueingError("give one or more arrival rates, each >= 0")
    if servers > 1 and abs(service_cv - 1.0) > 1e-9:
        raise QueueingError("the multi-server priority formula needs exponential service (cv = 1)")
    capacity = servers / service_time
    total_load = sum(arrival_rates) * service_time
    if servers == 1:
        second_moment = service_time**2 * (1.0 + service_cv**2)
        # A saturated server is always busy: the residual work an arrival finds tends to E[S²]/2E[S].
        residual = sum(arrival_rates) * second_moment / 2.0 if total_load < 1 else second_moment / (2 * service_time)
    else:
        residual = erlang_c(servers, total_load) / capacity
    waits = []
    sigma_before = 0.0
    for rate in arrival_rates:
        sigma = sigma_before + rate / capacity
        waits.append(math.inf if sigma >= 1.0 else residual / ((1.0 - sigma_before) * (1.0 - sigma)))
        sigma_before = sigma
    return waits


@dataclass(frozen=True)
class CapacityDrop:
    """A pool before and after losing part of its capacity, and what it takes to stay bounded.

    ``shed_to_stay_bounded`` is the least arrivals/s to refuse so utilization stays below 1;
    ``shed_to_recover`` brings utilization back to where it was before the loss.
    """

    loss_fraction: float
    before: QueueResult
    after: QueueResult
    shed_to_stay_bounded: float
    shed_to_recover: float

    @property
    def wait_ratio(self) -> float:
        """Mean wait after ÷ before (inf when the pool went unstable)."""
        return self.after.mean_wait / self.before.mean_wait if self.before.mean_wait > 0 else math.inf


def capacity_drop(arrival_rate: float, service_time: float, servers: int, loss_fraction: float,
                  percentile: float = DEFAULT_PERCENTILE) -> CapacityDrop:
    """What happens to waits when a fraction of a pool's capacity goes away.

    One server is slowed (service time ÷ (1 − loss)); a pool of many loses whole servers
    (⌊c (1 − loss)⌋ remain), the way replicas fail. With many seats, utilization near 0.8
    and a 30% loss, the offered load exceeds what is left: the queue grows without bound, and
    only shedding ``shed_to_stay_bounded`` arrivals/s (or more) keeps it finite.
    """
    if not 0 <= loss_fraction < 1:
        raise QueueingError(f"loss fraction must be in [0, 1), got {loss_fraction}")
    before = mmc(arrival_rate, service_time, servers, percentile)
    if servers == 1:
        servers_after, service_after = 1, service_time / (1.0 - loss_fraction)
    else:
        servers_after, service_after = max(1, math.floor(servers * (1.0 - loss_fraction) + 1e-9)), service_time
    after = mmc(arrival_rate, service_after, servers_after, percentile)
    capacity_after = servers_after / service_after
    return CapacityDrop(
        loss_fraction=loss_fraction, before=before, after=after,
        # "Bounded" needs utilization strictly below 1; shedding exactly the excess leaves it at 1.
        shed_to_stay_bounded=max(0.0, arrival_rate - capacity_after),
        shed_to_recover=max(0.0, arrival_rate - min(before.utilization, 1.0) * capacity_after),
    )


def solve_mm1_from_waits(wait_before: float, wait_after: float, loss_fraction: float) -> tuple[float, float]:
    """The utilization ρ and service time S of an M/M/1 pool whose mean wait goes from
    ``wait_before`` to ``wait_after`` when ``loss_fraction`` of its speed is lost.

    With r = after ÷ before and k = 1 − loss, the M/M/1 wait ρS/(1 − ρ) gives
    ``ρ = (r k² − 1) / (r k − 1)`` and then ``S = wait_before (1 − ρ) / ρ``.
    """
    _check(wait_before=wait_before, wait_after=wait_after)
    if not 0 < loss_fraction < 1:
        raise QueueingError(f"loss fraction must be in (0, 1), got {loss_fraction}")
    ratio, keep = wait_after / wait_before, 1.0 - loss_fraction
    if ratio * keep <= 1.0:
        raise QueueingError("the wait must grow by more than 1/(1 - loss) for an M/M/1 pool to explain it")
    rho = (ratio * keep**2 - 1.0) / (ratio * keep - 1.0)
    if not 0 < rho < keep:
        raise QueueingError(f"no stable M/M/1 pool explains these waits (solved utilization {rho:.3f})")
    return rho, wait_before * (1.0 - rho) / rho


def shed_for_utilization(arrival_rate: float, service_time: float, servers: int, target_utilization: float) -> float:
    """Arrivals/s to refuse so the pool runs at ``target_utilization`` or less."""
    _check(service_time=service_time)
    if not 0 < target_utilization < 1:
        raise QueueingError(f"target utilization must be in (0, 1), got {target_utilization}")
    return max(0.0, arrival_rate - target_utilization * servers / service_time)


def max_arrival_rate_for_wait(service_time: float, servers: int, target_wait: float,
                              percentile: float | None = None) -> float:
    """The highest arrival rate at which the mean wait (or its ``percentile``) stays ≤ ``target_wait``.

    Waits grow monotonically with the arrival rate, so a bisection on (0, c/S) finds it to
    within one part in 10⁹ of the capacity.
    """
    _check(service_time=service_time)
    if target_wait < 0:
        raise QueueingError(f"target wait must be >= 0, got {target_wait}")

    def wait_at(rate: float) -> float:
        result = mmc(rate, service_time, servers, percentile or DEFAULT_PERCENTILE)
        return result.percentile_wait if percentile is not None else result.mean_wait

    low, high = 0.0, servers / service_time
    for _ in range(100):
        mid = (low + high) / 2
        if wait_at(mid) <= target_wait:
            low = mid
        else:
            high = mid
        if high - low < 1e-9 * servers / service_time:
            break
    return low


def shed_for_wait(arrival_rate: float, service_time: float, servers: int, target_wait: float,
                  percentile: float | None = None) -> float:
    """Arrivals/s to refuse so the mean wait (or its ``percentile``) is at most ``target_wait``."""
    return max(0.0, arrival_rate - max_arrival_rate_for_wait(service_time, servers, target_wait, percentile))


def _check(**values: float) -> None:
    for name, value in values.items():
        if name == "percentile":
            if not 0 < value < 1:
                raise QueueingError(f"percentile must be in (0, 1), got {value}")
        elif name == "arrival_rate":
            if not value >= 0 or math.isinf(value):
                raise QueueingError(f"arrival rate must be a finite number >= 0, got {value}")
        elif not value > 0 or math.isinf(value):
            raise QueueingError(f"{name.replace('_', ' ')} must be a positive finite number, got {value}")
