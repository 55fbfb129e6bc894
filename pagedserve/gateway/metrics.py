"""The gateway's Prometheus metrics, all named ``pagedserve_gateway_*``, in the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """Counters and histograms per tier and pool; one instance per app (no global registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ns, r = "pagedserve_gateway", self.registry
        self.admitted = Counter("admitted", "Requests forwarded to a replica.", ["tier", "pool"],
                                namespace=ns, registry=r)
        self.shed = Counter("shed", "Requests refused before reaching any replica, by reason "
                            "(rate_limited_tokens, rate_limited_requests, too_large, overloaded, "
                            "queue_timeout, limiter_unavailable, no_replica).", ["tier", "pool", "reason"],
                            namespace=ns, registry=r)
        self.tokens_reserved = Counter("tokens_reserved", "Tokens reserved from buckets before forwarding.",
                                       ["tier"], namespace=ns, registry=r)
        self.tokens_returned = Counter("tokens_returned", "Reserved tokens given back at reconciliation.",
                                       ["tier"], namespace=ns, registry=r)
        self.tokens_used = Counter("tokens_used", "Tokens charged after reconciliation (actual usage).",
                                   ["tier"], namespace=ns, registry=r)
        self.reconciled = Counter("reconciled", "Reservations settled, by how the response ended "
                                  "(usage, failed, disconnected, estimated, shed).", ["tier", "outcome"],
                                  namespace=ns, registry=r)
        self.queue_wait_estimate = Histogram("queue_wait_estimate_seconds", "Estimated queue wait in the chosen "
                                             "pool at the admission decision.", ["tier", "pool"],
                                             buckets=_WAIT_BUCKETS, namespace=ns, registry=r)
        self.queue_wait = Histogram("queue_wait_seconds", "Time a forwarded request waited in the gateway's "
                                    "queue for a seat.", ["tier", "pool"], buckets=_WAIT_BUCKETS,
                                    namespace=ns, registry=r)
        self.queued = Gauge("queued", "Requests waiting in the gateway's queue for a seat.", ["tier", "pool"],
                            namespace=ns, registry=r)
        self.ttft = Histogram("ttft_seconds", "Time from the gateway receiving a request to the first "
                              "response byte from the replica.", ["tier", "pool"], buckets=_WAIT_BUCKETS,
                              namespace=ns, registry=r)
        self.limiter_errors = Counter("limiter_errors", "Limiter store (Redis) calls that failed or timed out.",
                                      namespace=ns, registry=r)
        self.limiter_fail_open = Counter("limiter_fail_open", "Requests admitted unmetered because the limiter "
                                         "was unavailable and the tier fails open.", ["tier"],
                                         namespace=ns, registry=r)
        self.limiter_up = Gauge("limiter_up", "1 while the limiter store answers (breaker closed), else 0.",
                                namespace=ns, registry=r)
        self.replica_up = Gauge("replica_up", "1 while a replica is in routing.", ["pool", "replica"],
                                namespace=ns, registry=r)
        self.replica_wait = Gauge("replica_est_wait_seconds", "Estimated queue wait on a replica for the "
                                  "best priority.", ["pool", "replica"], namespace=ns, registry=r)
        self.limiter_up.set(1)
