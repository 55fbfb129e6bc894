"""`pagedserve bench serve` (W4) against the shared server, scaled down to fit the test budget."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from pagedserve.bench import serve as bench_serve
from pagedserve.bench.workloads import w1_offline


def test_bench_serve_reports_percentiles_and_plot(server_url: str, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--url", server_url, "--rates", "40,inf", "--num-requests", "8",
                              "--prompt-len", "16:64", "--output-len", "4:12", "--out", str(tmp_path),
                              "--temperature", "1", "--no-progress"])  # sampled, as vLLM's client gets
    assert args.func(args) == 0
    report = json.loads((tmp_path / "w4.json").read_text())
    assert [r["rate"] for r in report["results"]] == ["40.0", "inf"]
    for r in report["results"]:
        assert r["completed"] == 8 and r["failed"] == 0
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p95"] <= r["ttft_ms"]["p99"]
        assert 0 < r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
        assert r["e2e_s"]["p50"] * 1000 >= r["ttft_ms"]["p50"] * 0.99
        assert r["output_tokens_per_s"] > 0 and r["request_throughput"] > 0
    assert (tmp_path / "w4_latency_cdf.png").stat().st_size > 10_000
    assert "TTFT p50/p95/p99" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [-0.1, 2.5])
def test_temperature_outside_the_api_range_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        bench_serve.ServeBenchConfig(url="http://unused", temperature=bad)


def test_w1_lengths_and_arrivals_are_seeded() -> None:
    cfg = bench_serve.ServeBenchConfig(url="http://unused", num_requests=64)
    assert bench_serve.w1_requests(cfg) == w1_offline(64)  # the very requests of W1
    assert all(64 <= len(r.prompt_token_ids) <= 512 and 32 <= r.output_len <= 256 for r in w1_offline(64))
    offsets = bench_serve.poisson_offsets(2000, 4.0, 0)
    assert offsets == sorted(offsets) and abs(offsets[-1] / 2000 - 0.25) < 0.03  # mean gap 1/rate
    assert bench_serve.poisson_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
