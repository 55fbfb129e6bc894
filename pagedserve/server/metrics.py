"""Prometheus metrics, all named ``pagedserve:*`` (documented one by one in docs/SERVER.md), plus
``vllm:num_requests_running`` and ``vllm:num_requests_waiting``: the two gauges a gateway or
autoscaler written for vLLM reads, so such tools work with this server unchanged.

Two sources: the engine's stats snapshot, read at scrape time by a custom collector (gauges and
the engine's own cumulative counters), and the step thread's outputs, which feed the request
counters and the latency histograms through :class:`ServerMetrics` acting as a ``StepObserver``.
Each app gets its own ``CollectorRegistry``: no process-wide globals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine.outputs import EngineStats, RequestOutput

NS = "pagedserve:"
VLLM_NS = "vllm:"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def kv_utilization(stats: EngineStats) -> float:
    """Tokens in use ÷ slots in allocated blocks; 0 when nothing is allocated (idle reads as 0)."""
    return stats.kv_tokens_in_use / stats.kv_slots_allocated if stats.kv_slots_allocated else 0.0


def naive_kv_utilization(stats: EngineStats) -> float:
    """What utilization a server reserving max_model_len per live request would have."""
    return stats.kv_tokens_in_use / stats.naive_reserved_tokens if stats.naive_reserved_tokens else 0.0


class _EngineStatsCollector(Collector):
    """Gauges and cumulative counters read from the engine's latest stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._stats()

        def gauge(name: str, doc: str, value: float, ns: str = NS) -> GaugeMetricFamily:
            g = GaugeMetricFamily(ns + name, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(NS + name, doc, labels=["model_name"])
            c.add_metric([self._model], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).", s.num_waiting)
        # The same two figures under vLLM's names (see the module docstring).
        yield gauge("num_requests_running", "Requests in the running batch (vLLM's name).", s.num_running,
                    ns=VLLM_NS)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (vLLM's name).", s.num_waiting,
                    ns=VLLM_NS)
        yield gauge("kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield gauge("kv_blocks_used", "KV cache blocks referenced by live requests.", s.kv_blocks_used)
        yield gauge("kv_blocks_cached_free", "Unreferenced blocks kept for prefix reuse (evictable).",
                    s.kv_blocks_cached_free)
        yield gauge("kv_tokens_in_use", "Tokens whose K/V live requests hold.", s.kv_tokens_in_use)
        yield gauge("kv_slots_allocated", "Token slots in the blocks live requests hold.", s.kv_slots_allocated)
        yield gauge("kv_utilization", "Tokens in use / slots allocated (0 when idle).", kv_utilization(s))
        yield gauge("kv_naive_reserved_tokens",
                    "Counterfactual: slots a worst-case server would reserve (live requests x max_model_len).",
                    s.naive_reserved_tokens)
        yield gauge("kv_naive_utilization", "Counterfactual: tokens in use / naive reserved slots.",
                    naive_kv_utilization(s))
        yield gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up.",
                    s.prefix_hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens)
        yield counter("num_preemptions", "Requests preempted (blocks taken back, recomputed later).",
                      s.num_preemptions)
        yield counter("generation_tokens", "Tokens generated, streamed or not (an aborted request's included).",
                      s.generation_tokens)


class ServerMetrics:
    """The server's registry plus the step observer that feeds request counters and histograms.

    ``on_outputs``/``on_abort`` run on the engine's step thread; the per-request timing dict is
    only touched there.
    """

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.requests_finished = Counter(NS + "request_success", "Requests finished, by finish reason.",
                                         labels + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter(NS + "prompt_tokens", "Prompt tokens prefilled.", labels,
                                     registry=self.registry)
        self.ttft = Histogram(NS + "time_to_first_token_seconds", "Arrival at the server to first generated token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(NS + "inter_token_latency_seconds", "Time between a request's consecutive steps' tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(NS + "e2e_request_latency_seconds", "Arrival at the server to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(NS + "request_queue_time_seconds",
                                    "Entering the engine's waiting queue to first scheduled.", labels,
                                    buckets=_LATENCY_BUCKETS, registry=self.registry)
        # Create the served model's series now, so a scrape before the first request already shows
        # every counter and histogram at zero (dashboards and rate() need the series to exist).
        for metric in (self.prompt_tokens, self.ttft, self.itl, self.e2e, self.queue_time):
            metric.labels(model_name)
        self.registry.register(_EngineStatsCollector(stats, model_name))
        self._last_token_time: dict[str, float] = {}

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self.registry)

    # ---- StepObserver ------------------------------------------------------------------------

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Observe one step's outputs: token counters, TTFT, inter-token gaps, finishes."""
        m = self.model_name
        for out in outputs:
            new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
            last = self._last_token_time.get(out.request_id)
            if new_tokens:
                if last is None:
                    self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
                    first = out.metrics.first_token_time or now
                    self.ttft.labels(m).observe(max(0.0, first - out.metrics.arrival_time))
                    if out.metrics.first_scheduled_time is not None:
                        self.queue_time.labels(m).observe(
                            max(0.0, out.metrics.first_scheduled_time - out.metrics.queued_time))
                else:
                    # "Time per output token": with --stream-interval N one output can carry up to N
                    # tokens per sequence, produced over that many steps since the previous output. Split
                    # the gap evenly and observe it once per step covered, so the histogram's count and
                    # mean match what per-token streaming would record for the same run. (n > 1: the
                    # sequences advance together, so the longest delta is the number of steps.)
                    steps = max(len(c.delta_token_ids) for c in out.outputs)
                    gap = max(0.0, now - last) / steps
                    itl = self.itl.labels(m)
                    for _ in range(steps):
                        itl.observe(gap)
                self._last_token_time[out.request_id] = now
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                reason = "error" if out.error is not None else (out.outputs[0].finish_reason if out.outputs else None)
                self.requests_finished.labels(m, reason or "stop").inc()
                end = out.metrics.finished_time or now
                self.e2e.labels(m).observe(max(0.0, end - out.metrics.arrival_time))

    def on_abort(self, request_id: str, now: float) -> None:
        """Count an aborted request (client gone or shutdown)."""
        self._last_token_time.pop(request_id, None)
        self.requests_finished.labels(self.model_name, "abort").inc()
