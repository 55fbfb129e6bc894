"""Prometheus metrics: the project's own ``pagedserve_*`` names and vLLM's ``vllm:*`` names, side by side.

Naming (docs/SERVER.md, "Metrics"): the project's names follow Prometheus's rules — snake case,
namespace ``pagedserve_``, the gateway's under ``pagedserve_gateway_``, no colons (Prometheus keeps
those for recording rules). vLLM's names are spelled exactly as vLLM spells them, colon included,
with vLLM's types, labels (``model_name`` and ``engine``), units and histogram buckets, so that
routers, autoscalers and Grafana dashboards written for vLLM (llm-d's inference scheduler,
production-stack, AIBrix, Dynamo; docs/SCALE_OUT.md) read this server unchanged. Both sets are
always emitted: they cost one scrape's formatting, and a flag would only be one more way for a
router to find nothing.

Two sources feed them: the engine's stats snapshot, read at scrape time by a collector (gauges and
the engine's own cumulative counters), and the outputs the client delivers, which feed the request
counters and latency histograms through :class:`ServerMetrics` acting as a ``StepObserver``. A scrape
reads the latest snapshot the client holds and never waits for a step. Each app has its own
``CollectorRegistry``: no process-wide globals.

With ``serve --api-server-count N`` each front process counts only its own requests. The
supervisor then sets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh temporary directory) before starting
the fronts, so prometheus-client keeps every front's counters and histograms in memory-mapped
files there, and a scrape of any front sums all of them (its ``MultiProcessCollector``); the
engine-wide gauges and counters still come from the core's stats snapshot, which every front
receives. Summed series lose their ``_created`` samples (prometheus-client's multiprocess mode
has none).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from pagedserve.engine.wire import ModelFacts
from pagedserve.engine.outputs import EngineStats, RequestOutput

NS = "pagedserve_"
VLLM_NS = "vllm:"
# vLLM labels every series with the engine index (data-parallel rank); one engine here.
VLLM_ENGINE = "0"

# The project's buckets: finer at the low end, where a small model on a CPU lives.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# vLLM v1's boundaries (vllm/v1/metrics/loggers.py), so histogram_quantile over the vllm: series
# gives what it gives against vLLM.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM creates request_success for every finish reason up front, so each series exists at zero.
_VLLM_FINISH_REASONS = ("stop", "length", "abort")


def kv_utilization(stats: EngineStats) -> float:
    """Tokens in use ÷ slots in allocated blocks; 0 when nothing is allocated (idle reads as 0)."""
    return stats.kv_tokens_in_use / stats.kv_slots_allocated if stats.kv_slots_allocated else 0.0


def kv_cache_usage(stats: EngineStats) -> float:
    """vLLM's ``kv_cache_usage_perc``: the fraction of the pool's blocks that live requests hold
    (0–1). Cached blocks nobody holds are free (evictable), as in vLLM."""
    return stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0


def naive_kv_utilization(stats: EngineStats) -> float:
    """What utilization a server reserving max_model_len per live request would have."""
    return stats.kv_tokens_in_use / stats.naive_reserved_tokens if stats.naive_reserved_tokens else 0.0


class _EngineStatsCollector(Collector):
    """Gauges and cumulative counters read from the engine's latest stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, facts: ModelFacts | None,
                 restarts: Callable[[], int]):
        self._stats = stats
        self._restarts = restarts
        self._model = model_name
        self._facts = facts

    def collect(self) -> Iterator[Metric]:
        s = self._stats()  # one snapshot per scrape: both name sets agree exactly
        own, vllm = [self._model], [self._model, VLLM_ENGINE]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            vllm_name = name.startswith(VLLM_NS)
            g = GaugeMetricFamily(name if vllm_name else NS + name, doc,
                                  labels=["model_name", "engine"] if vllm_name else ["model_name"])
            g.add_metric(vllm if vllm_name else own, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            vllm_name = name.startswith(VLLM_NS)
            c = CounterMetricFamily(name if vllm_name else NS + name, doc,
                                    labels=["model_name", "engine"] if vllm_name else ["model_name"])
            c.add_metric(vllm if vllm_name else own, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).", s.num_waiting)
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
        yield counter("spec_decode_drafts", "Speculative decoding: verification steps of a sequence with drafts.",
                      s.spec_num_drafts)
        yield counter("spec_decode_draft_tokens", "Speculative decoding: draft tokens proposed.",
                      s.spec_num_draft_tokens)
        yield counter("spec_decode_accepted_tokens", "Speculative decoding: draft tokens the target model accepted.",
                      s.spec_num_accepted_tokens)
        yield gauge("spec_decode_acceptance_rate", "Speculative decoding: accepted / proposed draft tokens "
                    "since start (0 before any draft).", s.spec_acceptance_rate)
        # The server's, not the core's: a new core's stats start from zero, this count goes on.
        yield counter("engine_core_restarts", "Engine cores started in place of one that died "
                      "(serve --restart-engine-core).", self._restarts())

        # vLLM's names for the same snapshot.
        usage = kv_cache_usage(s)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. "
                    "DEPRECATED: Use vllm:kv_cache_usage_perc instead.", usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_queried_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_hit_tokens)
        yield counter("vllm:gpu_prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                      "tokens. DEPRECATED: Use vllm:prefix_cache_queries instead.", s.prefix_queried_tokens)
        yield counter("vllm:gpu_prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens. "
                      "DEPRECATED: Use vllm:prefix_cache_hits instead.", s.prefix_hit_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      s.spec_num_accepted_tokens)
        yield self._cache_config_info(s)

    def _cache_config_info(self, s: EngineStats) -> GaugeMetricFamily:
        """vLLM's info-style gauge (always 1): the pool's shape in labels; routers read block_size
        and num_gpu_blocks from it to turn block counts into tokens."""
        f = self._facts
        labels = {"block_size": str(s.block_size), "num_gpu_blocks": str(s.kv_blocks_total),
                  "cache_dtype": f.kv_dtype if f else "auto",
                  "enable_prefix_caching": str(f.enable_prefix_caching if f else True), "engine": VLLM_ENGINE}
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(labels))
        g.add_metric(list(labels.values()), 1.0)
        return g


class _Both:
    """One observation or increment fed to the project's series and vLLM's (labels already bound)."""

    def __init__(self, *children: object):
        self._children: Sequence = children

    def inc(self, amount: float = 1.0) -> None:
        for c in self._children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self._children:
            c.observe(value)


class ServerMetrics:
    """The server's registry plus the step observer that feeds request counters and histograms.

    ``on_outputs``/``on_abort`` run on the event loop as the client delivers outputs; the
    per-request timing dict is only touched there.
    """

    def __init__(self, model_name: str, stats: Callable[[], EngineStats], facts: ModelFacts | None = None,
                 restarts: Callable[[], int] = lambda: 0):
        self.registry = r = CollectorRegistry()
        own, vllm = ["model_name"], ["model_name", "engine"]
        self.model_name = m = model_name
        vl = (model_name, VLLM_ENGINE)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], vllm_doc: str,
                      vllm_buckets: tuple[float, ...]) -> _Both:
            return _Both(Histogram(NS + name, doc, own, buckets=buckets, registry=r).labels(m),
                         Histogram(VLLM_NS + name, vllm_doc, vllm, buckets=vllm_buckets, registry=r).labels(*vl))

        # Created now, so a scrape before the first request already shows every series at zero
        # (dashboards and rate() need the series to exist).
        self.prompt_tokens = _Both(
            Counter(NS + "prompt_tokens", "Prompt tokens prefilled.", own, registry=r).labels(m),
            Counter(VLLM_NS + "prompt_tokens", "Number of prefill tokens processed.", vllm, registry=r).labels(*vl))
        self._success = Counter(NS + "request_success", "Requests finished, by finish reason.",
                                own + ["finished_reason"], registry=r)
        self._vllm_success = Counter(VLLM_NS + "request_success", "Count of successfully processed requests.",
                                     vllm + ["finished_reason"], registry=r)
        for reason in _VLLM_FINISH_REASONS:
            self._vllm_success.labels(*vl, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival at the server to first generated token.",
                              _LATENCY_BUCKETS, "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's consecutive steps' tokens.",
                             _ITL_BUCKETS, "Histogram of inter-token latency in seconds.", VLLM_ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival at the server to finish.", _LATENCY_BUCKETS,
                             "Histogram of e2e request latency in seconds.", VLLM_REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Entering the engine's waiting queue to first scheduled.", _LATENCY_BUCKETS,
                                    "Histogram of time spent in WAITING phase for request.",
                                    VLLM_REQUEST_LATENCY_BUCKETS)
        engine = _EngineStatsCollector(stats, model_name, facts, restarts)
        r.register(engine)
        # Several front processes (prometheus-client chose its memory-mapped values at import, from
        # the same variable): scrape every front's files plus this front's copy of the engine stats.
        self._exposed = r
        multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if multiproc_dir:
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed, path=multiproc_dir)
            self._exposed.register(engine)
        self._last_token_time: dict[str, float] = {}

    def render(self) -> bytes:
        """The exposition text for ``GET /metrics``."""
        return generate_latest(self._exposed)

    def _finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()
        self._vllm_success.labels(self.model_name, VLLM_ENGINE, reason).inc()

    # ---- StepObserver ------------------------------------------------------------------------

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Observe one step's outputs: token counters, TTFT, inter-token gaps, finishes."""
        for out in outputs:
            new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
            last = self._last_token_time.get(out.request_id)
            if new_tokens:
                if last is None:
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    first = out.metrics.first_token_time or now
                    self.ttft.observe(max(0.0, first - out.metrics.arrival_time))
                    if out.metrics.first_scheduled_time is not None:
                        self.queue_time.observe(max(0.0, out.metrics.first_scheduled_time - out.metrics.queued_time))
                else:
                    # "Time per output token": with --stream-interval N one output can carry up to N
                    # tokens per sequence, produced over that many steps since the previous output. Split
                    # the gap evenly and observe it once per step covered, so the histogram's count and
                    # mean match what per-token streaming would record for the same run. (n > 1: the
                    # sequences advance together, so the longest delta is the number of steps.)
                    steps = max(len(c.delta_token_ids) for c in out.outputs)
                    gap = max(0.0, now - last) / steps
                    for _ in range(steps):
                        self.itl.observe(gap)
                self._last_token_time[out.request_id] = now
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                reason = "error" if out.error is not None else (out.outputs[0].finish_reason if out.outputs else None)
                self._finished(reason or "stop")
                end = out.metrics.finished_time or now
                self.e2e.observe(max(0.0, end - out.metrics.arrival_time))

    def on_abort(self, request_id: str, now: float) -> None:
        """Count an aborted request (client gone or shutdown)."""
        self._last_token_time.pop(request_id, None)
        self._finished("abort")
