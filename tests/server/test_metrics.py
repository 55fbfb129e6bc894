"""/metrics parses with prometheus-client's parser; KV gauges move during a run and return to zero.
/load reports the same figures as JSON for the gateway."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.servers import wait_for_idle

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_blocks_total", "kv_blocks_used",
          "kv_blocks_cached_free", "kv_tokens_in_use", "kv_slots_allocated", "kv_utilization",
          "kv_naive_reserved_tokens", "kv_naive_utilization", "prefix_cache_hit_rate"]
COUNTERS = ["request_success", "prompt_tokens", "generation_tokens", "prefix_cache_queries",
            "prefix_cache_hits", "num_preemptions", "engine_core_restarts"]
VLLM_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"]


def scrape(url: str) -> dict[str, float]:
    """Sample name (with labels folded in for request_success) → value, via the official parser."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        # vLLM's names are exported too (for tools written for vLLM): test_metrics_contract.py.
        assert family.name.startswith(("pagedserve_", "vllm:")), family.name
        for s in family.samples:
            key = s.name
            if "finished_reason" in s.labels:
                key += f"[{s.labels['finished_reason']}]"
            if s.name.endswith("_bucket"):
                continue
            values[key] = s.value
    return values


def test_metrics_parse_and_name_everything(server_url: str) -> None:
    values = scrape(server_url)
    for name in GAUGES:
        assert f"pagedserve_{name}" in values, name
    for name in COUNTERS:
        if name != "request_success":
            assert f"pagedserve_{name}_total" in values, name
    for name in HISTOGRAMS:
        assert f"pagedserve_{name}_count" in values, name
    for name in VLLM_GAUGES:
        assert values[name] == values[name.replace("vllm:", "pagedserve_")], name
    assert values["pagedserve_kv_blocks_total"] == 512
    assert values["pagedserve_engine_core_restarts_total"] == 0  # without --restart-engine-core: never


def test_kv_gauges_move_during_a_run_and_return_to_zero(server_url: str) -> None:
    wait_for_idle(server_url)
    before = scrape(server_url)
    assert before["pagedserve_kv_blocks_used"] == 0 and before["pagedserve_kv_tokens_in_use"] == 0
    n_requests, max_tokens = 6, 120
    errors: list[str] = []

    def run(i: int) -> None:
        r = httpx.post(f"{server_url}/v1/completions", timeout=60,
                       json={"prompt": f"request number {i}", "max_tokens": max_tokens, "ignore_eos": True})
        if r.status_code != 200:
            errors.append(r.text)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_requests)]
    for t in threads:
        t.start()
    peak_blocks = peak_running = peak_load_blocks = 0.0
    peak_util = 0.0
    while any(t.is_alive() for t in threads):
        during = scrape(server_url)
        peak_blocks = max(peak_blocks, during["pagedserve_kv_blocks_used"])
        peak_running = max(peak_running, during["pagedserve_num_requests_running"])
        for name in VLLM_GAUGES:  # one scrape reads one stats snapshot: vLLM's names agree exactly
            assert during[name] == during[name.replace("vllm:", "pagedserve_")], name
        peak_util = max(peak_util, during["pagedserve_kv_utilization"])
        load = httpx.get(f"{server_url}/load", timeout=10).json()
        peak_load_blocks = max(peak_load_blocks, load["kv_blocks_used"])
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert not errors, errors
    assert peak_blocks > 0 and peak_running > 0 and peak_load_blocks > 0
    assert 0 < peak_util <= 1.0
    wait_for_idle(server_url)
    after = scrape(server_url)
    for gauge in ("kv_blocks_used", "kv_tokens_in_use", "kv_slots_allocated", "num_requests_running",
                  "num_requests_waiting", "kv_naive_reserved_tokens"):
        assert after[f"pagedserve_{gauge}"] == 0, gauge
    assert after["pagedserve_generation_tokens_total"] - before["pagedserve_generation_tokens_total"] == \
        n_requests * max_tokens
    assert after["pagedserve_request_success_total[length]"] - \
        before.get("pagedserve_request_success_total[length]", 0) == n_requests
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"pagedserve_{h}_count"] - before[f"pagedserve_{h}_count"] == n_requests, h
    assert after["pagedserve_inter_token_latency_seconds_count"] - \
        before["pagedserve_inter_token_latency_seconds_count"] == n_requests * (max_tokens - 1)


def test_load_report_fields(server_url: str) -> None:
    load = httpx.get(f"{server_url}/load", timeout=10).json()
    assert set(load) == {"model", "running", "waiting", "max_num_seqs", "kv_blocks_used", "kv_blocks_cached",
                         "kv_blocks_total", "kv_utilization", "tokens_per_s", "est_queue_wait_s"}
    assert load["kv_blocks_total"] == 512 and load["max_num_seqs"] >= 1
    assert load["est_queue_wait_s"] == 0.0  # idle: a new request would not wait
    assert httpx.get(f"{server_url}/health", timeout=10).status_code == 200
