"""The settings of a pagedserve Ray Serve application, checked before anything starts.

Kept free of ``ray`` imports so the CLI can validate flags (and print ``--help``) without Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bounds: each setting is a count or a duration a real deployment might use, nothing past it.
MAX_REPLICAS = 1024
MAX_ONGOING = 100_000


@dataclass
class RaySettings:
    """How many replicas, how much each takes, how requests reach them.

    ``max_ongoing_requests``: requests one replica holds at once (Ray's cap; keep it at or above
    the engine's ``max_num_seqs`` plus the queue the engine should hold itself).
    ``max_queued_requests``: requests the front may hold waiting for a replica slot; past it the
    front answers 503 ``queue_full`` with ``Retry-After`` (-1: no limit, Ray's default).
    ``min_replicas`` / ``max_replicas``: autoscaling bounds (both None: ``num_replicas`` fixed),
    scaling on ``target_ongoing_requests`` per replica.
    """

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 64
    max_queued_requests: int = 256
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0
    front_replicas: int = 1
    front_num_cpus: float = 0.0
    affinity_slack_s: float = 0.25
    default_service_s: float = 2.0
    routing_stats_period_s: float = 0.5
    retries: int = 1  # a request whose replica died before answering is sent again this many times
    # A stopping replica waits this long before it first checks that no request is left (time for the
    # routers to stop sending it any), then again between checks: Ray's graceful_shutdown_wait_loop_s.
    drain_check_s: float = 2.0
    app_name: str = "pagedserve"

    def __post_init__(self) -> None:
        def count(name: str, lo: int, hi: int, allow: tuple[int, ...] = ()) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi or v in allow):
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")

        def number(name: str, lo: float, hi: float, open_lo: bool = False) -> None:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v > hi or v < lo or (open_lo and v == lo):
                raise ValueError(f"{name} must be a number in {'(' if open_lo else '['}{lo}, {hi}], got {v!r}")

        count("num_replicas", 1, MAX_REPLICAS)
        count("front_replicas", 1, MAX_REPLICAS)
        count("max_ongoing_requests", 1, MAX_ONGOING)
        count("max_queued_requests", 0, MAX_ONGOING, allow=(-1,))
        count("retries", 0, 5)
        number("target_ongoing_requests", 0, MAX_ONGOING, open_lo=True)
        number("replica_num_cpus", 0, 1024)
        number("replica_num_gpus", 0, 64)
        number("front_num_cpus", 0, 1024)
        number("affinity_slack_s", 0, 3600)
        number("default_service_s", 0, 3600, open_lo=True)
        number("routing_stats_period_s", 0.05, 3600)
        number("drain_check_s", 0, 3600, open_lo=True)
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give both min_replicas and max_replicas (autoscaling), or neither")
        if self.min_replicas is not None:
            count("min_replicas", 0, MAX_REPLICAS)
            count("max_replicas", 1, MAX_REPLICAS)
            assert self.max_replicas is not None
            if self.min_replicas > self.max_replicas:
                raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas "
                                 f"({self.max_replicas})")
        if not self.app_name or len(self.app_name) > 64:
            raise ValueError("app_name must be 1 to 64 characters")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None
