"""``pagedserve bench serve``: workload W4 (docs/WORKLOADS.md) against an OpenAI-compatible server.

Poisson arrivals at several rates; prompt and output lengths from W1 (prompt uniform in
[64, 512], output uniform in [32, 256], seed 0; random non-special token ids; ``ignore_eos`` so
every request produces exactly its output length); every request streamed. Reports request
throughput, output tokens/s, TTFT, inter-token latency and end-to-end latency at p50/p95/p99,
writes a JSON file and a latency-CDF PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from pagedserve.bench.common import percentiles
from pagedserve.bench.processes import engine_server
from pagedserve.bench.sse_client import CLIENT_ERRORS, stream_post
from pagedserve.bench.sse_client import session as sse_session
from pagedserve.bench.workloads import BenchRequest, random_prompt

DEFAULT_RATES = "1,2,4,inf"


@dataclass
class ServeBenchConfig:
    """One W4 run: which server, which rates, which request lengths."""

    url: str
    model: str | None = None
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0, math.inf])
    num_requests: int = 64
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 256)
    vocab_size: int = 32000  # prompts are random non-special ids below this
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None
    temperature: float = 0.0  # 1.0 is what vLLM's bench serve gets (it sends none: the server default)

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError("rates must be positive request/s values (or inf)")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2] (the OpenAI API's range), got {self.temperature}")
        for name, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be LO:HI with 0 < LO <= HI, got {lo}:{hi}")


@dataclass
class RequestRecord:
    """What one streamed request saw, in seconds from its own send time."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None


@dataclass
class RateResult:
    """Figures for one arrival rate."""

    rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_s: dict[str, float]
    ttfts: list[float] = field(default_factory=list, repr=False)
    e2es: list[float] = field(default_factory=list, repr=False)


def w1_requests(cfg: ServeBenchConfig) -> list[BenchRequest]:
    """W1's requests (the same draws as ``workloads.w1_offline`` for the default ranges)."""
    rng = np.random.default_rng(cfg.seed)
    prompt_lens = rng.integers(cfg.prompt_len[0], cfg.prompt_len[1], endpoint=True, size=cfg.num_requests)
    output_lens = rng.integers(cfg.output_len[0], cfg.output_len[1], endpoint=True, size=cfg.num_requests)
    return [BenchRequest(random_prompt(rng, int(p), cfg.vocab_size), int(o)) for p, o in zip(prompt_lens, output_lens)]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from start) of ``n`` Poisson arrivals at ``rate``/s; all at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def _one_request(http: aiohttp.ClientSession, model: str, prompt: list[int], output_len: int,
                       cache_salt: str, temperature: float = 0.0) -> RequestRecord:
    rec = RequestRecord(prompt_tokens=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "cache_salt": cache_salt}
    start = time.perf_counter()
    last = start
    try:
        async with stream_post(http, "/v1/completions", body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.body())[:200]!r}"
                return rec
            async for data in r.data_lines():
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "stream error")
                    return rec
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itls.append(now - last)
                    last = now
        rec.e2e = time.perf_counter() - start
    except CLIENT_ERRORS as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def run_rate(cfg: ServeBenchConfig, model: str, rate: float, progress: object | None = None) -> RateResult:
    """Offer the W1 requests at ``rate`` (Poisson) and measure."""
    requests = [(r.prompt_token_ids, r.output_len) for r in w1_requests(cfg)]
    offsets = poisson_offsets(len(requests), rate, cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with sse_session(cfg.url, cfg.timeout_s, headers) as http:
        # Warm-up: one short request so the first measured one does not pay for lazy setup.
        await _one_request(http, model, requests[0][0][:16], 2, cache_salt="w4-warm-up")
        # Every rate replays the same W1 prompts: a salt per run keeps one run's prefix cache from
        # serving the next one's prompts (within a run the random prompts share nothing anyway).
        salt = f"w4-seed{cfg.seed}-rate{rate:g}-{time.time_ns()}"
        t0 = time.perf_counter()

        async def launch(offset: float, prompt: list[int], out_len: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            rec = await _one_request(http, model, prompt, out_len, salt, cfg.temperature)
            if progress is not None:
                progress.update(1)  # type: ignore[attr-defined]
            return rec

        records = await asyncio.gather(*(launch(o, p, n) for o, (p, n) in zip(offsets, requests)))
        duration = time.perf_counter() - t0
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return RateResult(
        rate=rate, completed=len(ok), failed=len(records) - len(ok), duration_s=duration,
        request_throughput=len(ok) / duration, output_tokens_per_s=out_tokens / duration,
        total_tokens_per_s=(in_tokens + out_tokens) / duration,
        ttft_ms=percentiles([r.ttft for r in ok if r.ttft is not None], 1000.0),
        itl_ms=percentiles([x for r in ok for x in r.itls], 1000.0),
        e2e_s=percentiles([r.e2e for r in ok if r.e2e is not None]),
        ttfts=[r.ttft for r in ok if r.ttft is not None], e2es=[r.e2e for r in ok if r.e2e is not None],
    )


def served_model(cfg: ServeBenchConfig) -> str:
    """The model name to send: ``cfg.model`` or the server's only model."""
    if cfg.model:
        return cfg.model
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return httpx.get(f"{cfg.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def run_benchmark(cfg: ServeBenchConfig, show_progress: bool = True) -> list[RateResult]:
    """Run every rate in turn against the server at ``cfg.url``."""
    from tqdm import tqdm

    model = served_model(cfg)
    results = []
    for rate in cfg.rates:
        with tqdm(total=cfg.num_requests, desc=f"W4 rate={rate:g}/s", disable=not show_progress,
                  file=sys.stderr) as bar:
            results.append(asyncio.run(run_rate(cfg, model, rate, bar)))
    return results


def format_table(results: list[RateResult]) -> str:
    """A markdown table of the figures (the one docs/BENCHMARKS.md records)."""
    lines = ["| rate (req/s) | done | failed | req/s | out tok/s | TTFT p50/p95/p99 (ms) | "
             "ITL p50/p95/p99 (ms) | E2E p50/p95/p99 (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, i, e = r.ttft_ms, r.itl_ms, r.e2e_s
        lines.append(f"| {r.rate:g} | {r.completed} | {r.failed} | {r.request_throughput:.2f} | "
                     f"{r.output_tokens_per_s:.1f} | {t['p50']:.0f} / {t['p95']:.0f} / {t['p99']:.0f} | "
                     f"{i['p50']:.1f} / {i['p95']:.1f} / {i['p99']:.1f} | "
                     f"{e['p50']:.2f} / {e['p95']:.2f} / {e['p99']:.2f} |")
    return "\n".join(lines)


def plot_cdf(results: list[RateResult], path: Path) -> None:
    """TTFT and end-to-end latency CDFs, one line per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        for ax, values, scale in ((axes[0], r.ttfts, 1000.0), (axes[1], r.e2es, 1.0)):
            if values:
                xs = np.sort(np.asarray(values) * scale)
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{r.rate:g} req/s")
    axes[0].set_xlabel("time to first token (ms)")
    axes[1].set_xlabel("end-to-end latency (s)")
    for ax in axes:
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("W4 serving load: latency CDF by arrival rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    return lo, hi


def _parse_rates(text: str) -> list[float]:
    try:
        return [math.inf if x.strip().lower() in ("inf", "max") else float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates such as 1,2,4,inf, got {text!r}") from None


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``bench serve``."""
    parser = bench_subparsers.add_parser(
        "serve", help="W4: Poisson load against an OpenAI-compatible server (TTFT/ITL/E2E percentiles)",
        description="Workload W4 of docs/WORKLOADS.md: streamed requests with W1's lengths, Poisson arrivals at each "
                    "rate in turn; prints a markdown table, writes JSON and a latency-CDF PNG. Either point it at "
                    "a running server (--url) or let it start one (--model).",
        epilog="examples:\n  pagedserve bench serve --url http://127.0.0.1:8000 --rates 1,2,4,inf\n"
               "  pagedserve bench serve --model ~/.cache/pagedserve/models/tiny --num-requests 32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", dest="server_model",
                        help="start `pagedserve serve --model MODEL` on a free port for the run "
                             "(default when neither is given: the built-in tiny model)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra flag for the started server, repeatable (e.g. --server-arg=--max-num-seqs=32)")
    parser.add_argument("--served-model", default=None, help="model name to send (default: the server's only one)")
    parser.add_argument("--rates", type=_parse_rates, default=_parse_rates(DEFAULT_RATES),
                        help=f"arrival rates in requests/s, comma-separated; inf = all at once (default {DEFAULT_RATES})")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per rate (default 64, as W1)")
    parser.add_argument("--prompt-len", type=_parse_range, default=(64, 512),
                        help="prompt length range LO:HI in tokens, uniform (default 64:512, W1)")
    parser.add_argument("--output-len", type=_parse_range, default=(32, 256),
                        help="output length range LO:HI in tokens, uniform (default 32:256, W1)")
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="prompt token ids are drawn below this (default 32000, the standard models)")
    parser.add_argument("--seed", type=int, default=0, help="seed of lengths, token ids and arrivals (default 0)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature sent with every request, 0..2 (default 0, greedy). 1 matches "
                             "vLLM's bench serve, which sends none and so gets the server's default of 1.0")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    parser.add_argument("--out", type=Path, default=Path("bench-results/serve"),
                        help="directory for w4.json and w4_latency_cdf.png (default bench-results/serve)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run W4 and write the report; returns 1 if any request failed."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the table
    try:
        cfg = ServeBenchConfig(url=args.url or "", model=args.served_model, rates=args.rates,
                               num_requests=args.num_requests, prompt_len=args.prompt_len,
                               output_len=args.output_len, vocab_size=args.vocab_size, seed=args.seed,
                               api_key=args.api_key, temperature=args.temperature)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.url:
        results = run_benchmark(cfg, show_progress=not args.no_progress)
    else:
        model = ["--model", args.server_model] if args.server_model else []
        with engine_server("--log-level", "warning", *model, *args.server_arg, timeout_s=300.0) as url:
            cfg.url = url
            results = run_benchmark(cfg, show_progress=not args.no_progress)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}  # never write the key to disk
    report = {"workload": "W4", "config": {**config, "rates": [str(r) for r in cfg.rates]},
              "results": [{k: v for k, v in asdict(r).items() if k not in ("ttfts", "e2es")} | {"rate": str(r.rate)}
                          for r in results]}
    (args.out / "w4.json").write_text(json.dumps(report, indent=2))
    plot_cdf(results, args.out / "w4_latency_cdf.png")
    print(format_table(results))
    print(f"\nwrote {args.out / 'w4.json'} and {args.out / 'w4_latency_cdf.png'}")
    return 1 if any(r.failed for r in results) else 0

