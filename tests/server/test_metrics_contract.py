"""The metrics contract routers and dashboards built for vLLM read (issue #16): every ``vllm:`` name
with vLLM's type, labels and histogram buckets, parsed by prometheus-client's own parser from a live
scrape of the real server; usage a fraction that moves during a run; and /metrics and /load answering
fast while 8 streams decode (they read the client's latest snapshot and never wait for a step).

The expected names, types and buckets are written out here from vLLM v1's definitions
(vllm/v1/metrics/loggers.py), independently of pagedserve/server/metrics.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.servers import run_engine_server, wait_for_idle

LABELS = {"model_name", "engine"}
CONTRACT = {  # family name (counters without _total, as the parser names them) -> type, extra labels
    "vllm:num_requests_running": ("gauge", set()),
    "vllm:num_requests_waiting": ("gauge", set()),
    "vllm:kv_cache_usage_perc": ("gauge", set()),
    "vllm:gpu_cache_usage_perc": ("gauge", set()),
    "vllm:prefix_cache_queries": ("counter", set()),
    "vllm:prefix_cache_hits": ("counter", set()),
    "vllm:gpu_prefix_cache_queries": ("counter", set()),
    "vllm:gpu_prefix_cache_hits": ("counter", set()),
    "vllm:num_preemptions": ("counter", set()),
    "vllm:prompt_tokens": ("counter", set()),
    "vllm:generation_tokens": ("counter", set()),
    "vllm:spec_decode_num_drafts": ("counter", set()),
    "vllm:spec_decode_num_draft_tokens": ("counter", set()),
    "vllm:spec_decode_num_accepted_tokens": ("counter", set()),
    "vllm:request_success": ("counter", {"finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", set()),
    "vllm:inter_token_latency_seconds": ("histogram", set()),
    "vllm:e2e_request_latency_seconds": ("histogram", set()),
    "vllm:request_queue_time_seconds": ("histogram", set()),
}
_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": _REQUEST_LATENCY,
    "vllm:request_queue_time_seconds": _REQUEST_LATENCY,
}
# Long enough for 20+ scrapes on a fast machine: on the shared server (contexts of 256) a Zen 5
# decoded 8 x 224 tokens in the time of 17, so this test has a server of its own with room for 1,000.
N_STREAMS, MAX_TOKENS = 8, 1000


@pytest.fixture(scope="module")
def busy_url(tiny_model_dir: Path) -> Iterator[str]:
    """A server of this module's own whose 8 streams of MAX_TOKENS fit its KV pool (8 x 64 blocks)."""
    with run_engine_server(tiny_model_dir, "--max-model-len", "1100", "--num-kv-blocks", "600", "--log-level",
                           "warning", timeout=120) as url:
        yield url


def families(url: str) -> dict:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """The one sample of ``family`` named ``sample`` (default: the family's own name) matching ``labels``."""
    name = sample or family
    found = [s.value for s in fams[family].samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (family, name, labels, found)
    return found[0]


def test_every_vllm_name_with_its_type_labels_and_buckets(server_url: str, model_name: str) -> None:
    fams = families(server_url)
    for name, (kind, extra) in CONTRACT.items():
        assert name in fams, f"{name} missing from /metrics"
        fam = fams[name]
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == LABELS | extra, (name, s.labels)
            assert s.labels["model_name"] == model_name and s.labels["engine"] == "0", s
        if kind == "counter":
            assert {s.name for s in fam.samples} <= {name + "_total", name + "_created"}, name
        if kind == "histogram":
            bounds = [float(s.labels["le"]) for s in fam.samples if s.name == name + "_bucket"]
            assert bounds == BUCKETS[name] + [float("inf")], name
    for reason in ("stop", "length", "abort"):  # created at zero, as vLLM does
        assert value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason=reason) >= 0
    info = fams["vllm:cache_config_info"]
    assert info.type == "gauge" and len(info.samples) == 1
    sample = info.samples[0]
    assert sample.value == 1
    assert sample.labels["block_size"] == "16" and sample.labels["num_gpu_blocks"] == "512", sample.labels
    assert sample.labels["enable_prefix_caching"] == "True" and sample.labels["engine"] == "0"
    # The project's own names stay beside vLLM's, in one style (snake case, pagedserve_ namespace).
    assert all(n.startswith(("pagedserve_", "vllm:")) for n in fams), sorted(fams)
    assert value(fams, "pagedserve_kv_blocks_total") == 512


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_usage_moves_and_scrapes_stay_fast_while_8_streams_decode(busy_url: str) -> None:
    wait_for_idle(busy_url)
    before = families(busy_url)
    assert value(before, "vllm:kv_cache_usage_perc") == 0
    errors: list[str] = []
    started = threading.Barrier(N_STREAMS + 1)

    def stream(i: int) -> None:
        body = {"prompt": f"stream {i} says", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        started.wait()
        with httpx.stream("POST", f"{busy_url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                errors.append(r.read().decode())
                return
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    started.wait()
    usages: list[float] = []
    generated: list[float] = []  # the engine's own counter, as each scrape sees it
    metrics_s: list[float] = []
    load_s: list[float] = []
    with httpx.Client(timeout=10) as http:
        # A bounded number of scrapes, taken while all 8 run (the scrape itself says so).
        while any(t.is_alive() for t in threads) and len(metrics_s) < 150:
            t0 = time.perf_counter()
            r = http.get(f"{busy_url}/metrics")
            elapsed = time.perf_counter() - t0
            fams = {f.name: f for f in text_string_to_metric_families(r.text)}
            t0 = time.perf_counter()
            load = http.get(f"{busy_url}/load").json()
            load_elapsed = time.perf_counter() - t0
            running = value(fams, "vllm:num_requests_running")
            assert running == value(fams, "pagedserve_num_requests_running")
            usage = value(fams, "vllm:kv_cache_usage_perc")
            assert 0.0 <= usage <= 1.0, usage
            assert value(fams, "vllm:gpu_cache_usage_perc") == usage
            assert usage == value(fams, "pagedserve_kv_blocks_used") / value(fams, "pagedserve_kv_blocks_total")
            if running == N_STREAMS and load["running"] == N_STREAMS:
                usages.append(usage)
                generated.append(value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total"))
                metrics_s.append(elapsed)
                load_s.append(load_elapsed)
            time.sleep(0.005)
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(metrics_s) >= 20, f"only {len(metrics_s)} scrapes while {N_STREAMS} streams decoded"
    assert 0 < min(usages) and len(set(usages)) > 1, usages  # blocks are added as the contexts grow
    # Fresh under load: the snapshot a scrape reads keeps moving while the streams decode.
    assert generated == sorted(generated) and len(set(generated)) >= 5, generated
    assert _p99(metrics_s) < 0.1, sorted(metrics_s)[-5:]
    assert _p99(load_s) < 0.1, sorted(load_s)[-5:]

    wait_for_idle(busy_url)
    after = families(busy_url)
    assert value(after, "vllm:kv_cache_usage_perc") == 0

    def delta(family: str, sample: str | None = None, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == N_STREAMS * MAX_TOKENS
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == N_STREAMS
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == \
        delta("pagedserve_prompt_tokens", "pagedserve_prompt_tokens_total") > 0
    assert delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == \
        delta("pagedserve_prefix_cache_queries", "pagedserve_prefix_cache_queries_total") > 0
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"vllm:{h}", f"vllm:{h}_count") == N_STREAMS, h
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == \
        N_STREAMS * (MAX_TOKENS - 1)
