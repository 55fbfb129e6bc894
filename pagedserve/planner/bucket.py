"""Token-bucket admission: what a bucket of ``burst`` tokens refilled at ``rate`` tokens/s lets through.

The closed forms treat traffic as a fluid; :func:`replay_token_bucket` replays discrete
requests exactly and is what the simulator uses, so the two can be checked against each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

PATTERNS = ("steady", "burst", "periodic")


class BucketError(ValueError):
    """Inputs to a token-bucket formula that make no sense."""


@dataclass(frozen=True)
class BucketAdmits:
    """Tokens offered and admitted over a window (and requests, when each costs ``cost`` tokens)."""

    pattern: str
    window: float
    offered_tokens: float
    admitted_tokens: float
    cost: float | None
    offered_requests: float | None
    admitted_requests: float | None

    @property
    def refused_tokens(self) -> float:
        """Tokens the bucket turned away."""
        return self.offered_tokens - self.admitted_tokens

    @property
    def admitted_fraction(self) -> float:
        """Admitted ÷ offered (1.0 when nothing was offered)."""
        return self.admitted_tokens / self.offered_tokens if self.offered_tokens > 0 else 1.0


def bucket_admits(rate: float, burst: float, window: float, offered_rate: float, pattern: str = "steady",
                  period: float | None = None, cost: float | None = None) -> BucketAdmits:
    """Tokens a full bucket admits over ``window`` seconds of traffic offered at ``offered_rate`` tokens/s.

    Patterns: ``steady`` (a constant stream; Poisson arrivals have the same mean) admits
    ``min(o T, b + r T)``: the bucket drains at ``o − r`` until empty, then passes the refill
    rate. ``burst`` offers everything at once at the start and admits ``min(o T, b)``.
    ``periodic`` offers ``o × period`` tokens at once every ``period`` seconds; each burst gets
    what the bucket holds, which refills by ``r × period`` (capped at ``b``) between bursts.
    With ``cost`` tokens per request, counts are whole requests (a partly paid one is refused).
    """
    if rate < 0 or burst < 0 or window < 0 or offered_rate < 0:
        raise BucketError("rate, burst, window and offered rate must all be >= 0")
    if pattern not in PATTERNS:
        raise BucketError(f"unknown arrival pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    if cost is not None and cost <= 0:
        raise BucketError(f"cost per request must be > 0, got {cost}")
    offered = offered_rate * window
    if pattern == "steady":
        admitted = min(offered, burst + rate * window)
        requests = None if cost is None else min(offered / cost, math.floor((burst + rate * window) / cost + 1e-9))
    elif pattern == "burst":
        admitted = min(offered, burst)
        requests = None if cost is None else min(offered / cost, math.floor(burst / cost + 1e-9))
    else:
        if period is None or period <= 0:
            raise BucketError("the periodic pattern needs a period > 0")
        bursts = max(1, math.floor(window / period + 1e-9))
        size = offered_rate * period
        times = np.arange(bursts) * period
        if cost is None:
            # One big "request" per burst that takes as much as the bucket holds: replay the level.
            level, admitted = burst, 0.0
            for i in range(bursts):
                if i:
                    level = min(burst, level + rate * period)
                take = min(size, level)
                level -= take
                admitted += take
            offered, requests = size * bursts, None
        else:
            per_burst = max(1, round(size / cost))
            arrival_times = np.repeat(times, per_burst)
            mask = replay_token_bucket(arrival_times, np.full(arrival_times.size, cost), rate, burst)
            requests = float(mask.sum())
            offered, admitted = cost * arrival_times.size, cost * requests
        return BucketAdmits(pattern, window, offered, admitted, cost,
                            None if cost is None else offered / cost, requests)
    return BucketAdmits(pattern, window, offered, admitted if cost is None else requests * cost, cost,
                        None if cost is None else offered / cost, requests)


def replay_token_bucket(arrival_times: Sequence[float] | np.ndarray, costs: Sequence[float] | np.ndarray,
                        rate: float, burst: float, initial: float | None = None) -> np.ndarray:
    """Which requests a token bucket admits, replayed exactly in arrival order.

    The bucket starts with ``initial`` tokens (default: full), gains ``rate`` tokens/s up to
    ``burst``, and admits a request only if it holds the request's whole cost, which it takes.
    Returns a boolean array, one entry per arrival.
    """
    if rate < 0 or burst < 0:
        raise BucketError("rate and burst must be >= 0")
    times = np.asarray(arrival_times, dtype=float)
    cost_arr = np.broadcast_to(np.asarray(costs, dtype=float), times.shape)
    admitted = np.zeros(times.shape, dtype=bool)
    level = burst if initial is None else min(initial, burst)
    last = times[0] if times.size else 0.0
    # A plain loop: each decision depends on the level the previous one left (tolist() keeps it fast).
    for i, (t, c) in enumerate(zip(times.tolist(), cost_arr.tolist())):
        if t < last:
            raise BucketError("arrival times must be sorted")
        level = min(burst, level + (t - last) * rate)
        last = t
        if level >= c - 1e-9:
            level -= c
            admitted[i] = True
    return admitted
