"""``pagedserve bench tiers``: workload W6 (docs/WORKLOADS.md) — paid and free traffic through the gateway.

One shared pool of engine replicas; paid (priority 0, queue-wait budget 1 s) and free (priority
10, budget 5 s) keys; ``--reserved-seats`` of the replica's seats are kept for paid. Phases, each
``--duration`` seconds of Poisson arrivals, every request streamed, each tier's arrivals sent by
a client process of its own (as separate tenants would; one event loop reading the free streams
would also delay the paid client's own timestamps):

1. calibrate: a closed loop of 2 × seats paid requests measures the pool's capacity C (requests/s;
   ``--capacity`` gives it instead, to compare builds at the same offered rates) and an idle
   request's TTFT;
2. ``paid-only``: paid at ``--paid-load`` × C (0.25 by default), no free traffic (the reference);
3. ``paid+free``: the same paid traffic plus free at ``--free-load`` × C (3 × by default);
4. and 5. the same two with 30% of the pool's seats removed (``--max-num-seqs`` × 0.7), same
   offered rates.

With ``--rounds N`` each seat count runs N alternated pairs of 2. and 3. (4. and 5.), each round
with arrivals and prompts of its own seed. A p95 over one 40-second phase rests on its dozen
slowest paid requests, and this machine's speed drifts between phases, so one pair's ratio moves
a lot from run to run; alternating spreads the drift over both sides, and the verdict is the
paid p95 pooled over every round of each side (also each round's own ratio, and their median).

Per tier: offered, admitted, shed (429, by error code; how many after waiting in the gateway's
queue), queue wait p50/p95 and TTFT p50/p95. Every request carries its own ``request_id``, and the
replica runs with ``--log-requests``, so each admitted request's figures are joined exactly:

- *queue wait* = time in the gateway's seat queue (its ``x-pagedserve-queue-wait-ms`` header) +
  time in the engine's waiting queue (the replica's ``queue_ms``: enqueued → the start of the
  scheduling pass that admits it, vLLM V1's stamps);
- *engine TTFT* = the replica's ``ttft_ms``: from its front end handing the parsed request to the
  engine core to the step that sampled its first token, so it includes the hop to the core,
  waiting for the step in flight and the prefill; of which *to the core* (``to_core_ms``) is the
  part before the core enqueued it: the hop and the wait for the step in flight;
- *TTFT* at the client, and *TTFT − idle* (the client TTFT minus an idle request's, floored at 0:
  what the paid tier feels, queueing or not, CPU contention included);
- *outside the engine* = client TTFT − engine TTFT, per request: the client, the gateway and the
  front end's own work (parsing the request, streaming the token), so a rise under free traffic
  is placed on one side or the other.

Writes ``w6.json``, ``w6_waits.png`` (per-tier distributions), the replicas' request logs and the
gateway's decision logs.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import re
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from pagedserve.bench.common import percentiles
from pagedserve.bench.processes import engine_server, free_port, running_process
from pagedserve.bench.sse_client import CLIENT_ERRORS, stream_post
from pagedserve.bench.sse_client import session as sse_session

PAID_KEY, FREE_KEY = "sk-w6-paid", "sk-w6-free"
_REQUEST_LINE = re.compile(
    r"request (\S+) finished: .*?(?:to_core_ms=(\S+) )?queue_ms=(\S+) ttft_ms=(\S+)")


@dataclass(frozen=True)
class EngineTimes:
    """One request's engine-side times in seconds, from its ``log_requests`` line."""

    queue: float  # the engine's waiting queue: enqueued -> the scheduling pass that admits it
    ttft: float  # the front handing the request over -> the step that sampled its first token
    to_core: float | None = None  # the front handing it over -> enqueued in the core (None: an older line)


def read_request_log(path: Path) -> dict[str, EngineTimes]:
    """request id → its :class:`EngineTimes`, from the ``log_requests`` lines ``log_finished``
    writes (engine/frontend/client.py: ``serve --log-requests``)."""
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _REQUEST_LINE.search(line)
        if m and m.group(3) != "-" and m.group(4) != "-":
            to_core = m.group(2)
            out[m.group(1)] = EngineTimes(float(m.group(3)) / 1000, float(m.group(4)) / 1000,
                                          float(to_core) / 1000 if to_core not in (None, "-") else None)
    return out


@dataclass
class TiersBenchConfig:
    """One W6 run."""

    model: str = "tiny"
    max_num_seqs: int = 8
    removed_fraction: float = 0.3
    duration_s: float = 45.0
    paid_load: float = 0.25   # × capacity
    free_load: float = 3.0    # × capacity
    prompt_len: int = 64
    output_len: int = 64
    paid_budget_s: float = 1.0
    free_budget_s: float = 5.0
    reserved_seats: int = 2   # of the replica's seats, kept for paid (free gets the rest)
    stream_interval: int = 1  # the replica's --stream-interval: tokens per streamed event after the first
    free_stream_interval: int = 1  # the gateway's stream_interval for the free tier (1: every token)
    seed: int = 0
    server_args: tuple[str, ...] = ()  # extra `pagedserve serve` arguments for the replica, e.g. ("--dtype=float32",)
    # Requests/s to take as the pool's capacity instead of measuring it: two builds compared at the
    # same offered rates (a measured capacity moves with the machine's load, and W6's loads with it).
    capacity_rps: float | None = None
    rounds: int = 1  # alternated (paid-only, paid+free) pairs per seat count, pooled in the verdict

    @property
    def reduced_seats(self) -> int:
        """The replica's seats in the phases with ``removed_fraction`` of them removed."""
        return max(1, round(self.max_num_seqs * (1 - self.removed_fraction)))

    def __post_init__(self) -> None:
        if self.max_num_seqs < 2 or not 0 < self.removed_fraction < 1:
            raise ValueError("max_num_seqs must be >= 2 and removed_fraction in (0, 1)")
        if not 0 <= self.reserved_seats < self.reduced_seats:
            raise ValueError("reserved_seats must be >= 0 and leave free at least one seat in every phase")
        if self.duration_s <= 0 or self.paid_load <= 0 or self.free_load < 0:
            raise ValueError("duration_s and paid_load must be > 0, free_load >= 0")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
        if self.stream_interval < 1 or self.free_stream_interval < 1:
            raise ValueError("stream_interval and free_stream_interval must be >= 1")
        if type(self.rounds) is not int or self.rounds < 1:
            raise ValueError("rounds must be a whole number >= 1")
        if self.capacity_rps is not None and not (math.isfinite(self.capacity_rps) and self.capacity_rps > 0):
            raise ValueError("capacity_rps must be a finite number of requests/s > 0")


@dataclass
class Shot:
    """One request as the client saw it."""

    tier: str
    status: int = 0
    code: str | None = None
    ttft: float | None = None
    est_wait: float | None = None  # the gateway's estimate at admission (x-pagedserve-est-queue-wait-ms)
    queued: float | None = None  # time spent in the gateway's queue, admitted or shed (x-pagedserve-queue-wait-ms)
    request_id: str = ""
    engine_queue: float | None = None  # the replica's queue time (its --log-requests line)
    engine_ttft: float | None = None  # the replica's TTFT, from the front handing the request to the core
    engine_to_core: float | None = None  # of which: until the core enqueued it (the hop, the step in flight)


@dataclass
class TierResult:
    """Per-tier figures of one phase (waits and TTFT in seconds)."""

    offered: int
    admitted: int
    shed: dict[str, int]
    errors: int
    queue_wait: dict[str, float]  # gateway seat queue + engine waiting queue, per request
    ttft: dict[str, float]  # at the client
    est_wait: dict[str, float]  # the gateway's own estimates at admission, for comparison
    gateway_queue: dict[str, float] = field(default_factory=dict)  # time admitted requests spent queued there
    engine_queue: dict[str, float] = field(default_factory=dict)
    engine_ttft: dict[str, float] = field(default_factory=dict)
    engine_to_core: dict[str, float] = field(default_factory=dict)
    ttft_excess: dict[str, float] = field(default_factory=dict)  # client TTFT − idle TTFT, floored at 0
    outside_engine: dict[str, float] = field(default_factory=dict)  # client TTFT − engine TTFT, per request
    unmatched: int = 0  # admitted requests without a replica log line (should be 0)
    shed_after_wait: int = 0  # 429s answered after waiting in the gateway's queue (the rest at once)
    waits: list[float] = field(default_factory=list, repr=False)  # queue waits, for the plot
    ttfts: list[float] = field(default_factory=list, repr=False)  # client TTFTs, for the plot


@dataclass
class PhaseResult:
    """One phase: its offered rates and each tier's result."""

    name: str
    seats: int
    paid_rate: float
    free_rate: float
    tiers: dict[str, TierResult]

    @property
    def pair_name(self) -> str:
        """The name without its round (`` #k`` with ``--rounds`` > 1): what the rounds of one side share."""
        return self.name.split(" #")[0]


@dataclass
class PaidVerdict:
    """W6's bar for one seat count: the paid client TTFT p95 with free traffic against without,
    per round and pooled over every round (seconds)."""

    seats: int
    phase: str  # the paid+free phase's name, without its round
    round_ratios: list[float]
    alone_p95: float
    with_free_p95: float

    @property
    def ratio(self) -> float:
        return self.with_free_p95 / self.alone_p95 if self.alone_p95 > 0 else math.nan

    @property
    def median_round_ratio(self) -> float:
        return float(np.median(self.round_ratios)) if self.round_ratios else math.nan


def paid_verdicts(phases: list[PhaseResult]) -> list[PaidVerdict]:
    """Per pool size (full, then with seats removed), in the order they ran: the paid tier's client
    TTFT p95 with free traffic against alone, each round's and pooled (the TTFTs of every round's
    phase of each side together). Phases come in (paid-only, paid+free) pairs; a pair's rounds
    share the phase name before `` #``."""
    pairs: dict[str, list[tuple[PhaseResult, PhaseResult]]] = {}
    for alone, mixed in zip(phases[0::2], phases[1::2]):
        pairs.setdefault(mixed.pair_name, []).append((alone, mixed))
    verdicts = []
    for name, rounds in pairs.items():
        sides = [[ph.tiers["paid"] for ph in side] for side in zip(*rounds)]  # [alone rounds], [mixed rounds]
        alone, mixed = ([t for r in side for t in r.ttfts] for side in sides)
        ratios = [m.ttft["p95"] / a.ttft["p95"] for a, m in zip(*sides) if a.ttft["p95"] > 0]
        verdicts.append(PaidVerdict(rounds[0][1].seats, name, ratios, percentiles(alone)["p95"],
                                    percentiles(mixed)["p95"]))
    return verdicts


def gateway_toml(engine_urls: list[str], cfg: TiersBenchConfig, port: int) -> str:
    """The gateway config of the run: one shared pool, paid outranks free."""
    replicas = ", ".join(f'"{u}"' for u in engine_urls)
    big = 10_000_000  # the buckets are not what W6 measures: shedding by queue wait is
    tiers = "".join(f"""
[tiers.{name}]
token_rate = {big}
token_burst = {big}
pools = ["shared"]
priority = {priority}
max_queue_wait_s = {budget}
stream_interval = {interval}
bucket = "tier"
""" for name, priority, budget, interval in (("paid", 0, cfg.paid_budget_s, 1),
                                             ("free", 10, cfg.free_budget_s, cfg.free_stream_interval)))
    return f"""
[gateway]
port = {port}
load_poll_interval_s = 0.1
default_service_s = 1.0

[pools.shared]
replicas = [{replicas}]
reserved_seats = {cfg.reserved_seats}
{tiers}
[keys]
"{PAID_KEY}" = "paid"
"{FREE_KEY}" = "free"
"""


@dataclass
class Stack:
    """A running W6 stack: the gateway's URL and the replica's request log."""

    url: str
    engine_log: Path


@contextlib.contextmanager
def serving_stack(model_dir: Path, seats: int, cfg: TiersBenchConfig, workdir: Path) -> Iterator[Stack]:
    """An engine replica with ``seats`` seats (logging every request) behind a gateway subprocess."""
    log_path = workdir / f"engine-{seats}.log"
    with open(log_path, "w+") as log, engine_server(
            "--model", str(model_dir), "--max-num-seqs", str(seats), "--served-model-name", "w6", "--log-requests",
            "--stream-interval", str(cfg.stream_interval),
            # W6 puts a gateway and two load generators on the replica's cores: the core steps aside
            # for their bursts (serve's option for a gateway on the same host; a later --server-arg wins)
            "--engine-core-nice", "10", *cfg.server_args, log=log) as engine_url:
        gport = free_port()
        toml = workdir / f"gateway-{seats}.toml"
        toml.write_text(gateway_toml([engine_url], cfg, gport))
        gateway = [sys.executable, "-m", "pagedserve.gateway", "--config", str(toml)]
        # The gateway's decision log (admit / shed, and how long each admitted request queued) is
        # kept beside the replica's: it says why a request waited.
        with open(workdir / f"gateway-{seats}.log", "w+") as gateway_log, \
                running_process(gateway, f"http://127.0.0.1:{gport}/health", log=gateway_log):
            yield Stack(f"http://127.0.0.1:{gport}", log_path)


async def _shot(http: aiohttp.ClientSession, tier: str, prompt: list[int], output_len: int,
                model: str = "w6") -> Shot:
    key = PAID_KEY if tier == "paid" else FREE_KEY
    # Unique across the run's phases and processes: the replica's request log is joined on it.
    request_id = f"w6-{tier}-{uuid.uuid4().hex}"
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "request_id": request_id}
    shot = Shot(tier, request_id=request_id)
    start = time.perf_counter()
    try:
        async with stream_post(http, "/v1/completions", body, {"Authorization": f"Bearer {key}"}) as r:
            shot.status = r.status
            if "x-pagedserve-est-queue-wait-ms" in r.headers:
                shot.est_wait = float(r.headers["x-pagedserve-est-queue-wait-ms"]) / 1000
            if "x-pagedserve-queue-wait-ms" in r.headers:
                shot.queued = float(r.headers["x-pagedserve-queue-wait-ms"]) / 1000
            if r.status != 200:
                try:
                    shot.code = json.loads(await r.body())["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    shot.code = f"http_{r.status}"
                return shot
            async for data in r.data_lines():
                if shot.ttft is None and data.startswith("{"):
                    shot.ttft = time.perf_counter() - start
    except CLIENT_ERRORS as e:
        shot.code = type(e).__name__
    return shot


def _prompts(n: int, cfg: TiersBenchConfig, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 31000, size=cfg.prompt_len).tolist() for _ in range(n)]


async def _tier_loop(url: str, cfg: TiersBenchConfig, index: int, tier: str, rate: float,
                     start_at: float) -> list[Shot]:
    """Poisson arrivals of one tier for ``duration_s`` from wall-clock time ``start_at``; all awaited.

    The arrival times and prompts depend only on the seed and the tier's index, so every run (and
    the two phases that share a tier's rate) offers the same requests."""
    rng = np.random.default_rng(cfg.seed + 17 * index)
    offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * cfg.duration_s * 1.5) + 10))
    offsets = offsets[offsets < cfg.duration_s]
    prompts = _prompts(len(offsets), cfg, cfg.seed + 101 * (index + 1))
    async with sse_session(url, 300) as http:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()

        async def launch(offset: float, prompt: list[int]) -> Shot:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await _shot(http, tier, prompt, cfg.output_len)
        return list(await asyncio.gather(*(launch(float(o), p) for o, p in zip(offsets, prompts))))


def _tier_process(url: str, cfg: TiersBenchConfig, index: int, tier: str, rate: float, start_at: float) -> list[Shot]:
    """Entry point of one tier's client process."""
    return asyncio.run(_tier_loop(url, cfg, index, tier, rate, start_at))


def _open_loop(url: str, cfg: TiersBenchConfig, rates: dict[str, float], progress: object | None) -> list[Shot]:
    """Every tier's arrivals at once, each tier from a client process of its own (module docstring)."""
    tiers = [(i, tier, rate) for i, (tier, rate) in enumerate(rates.items()) if rate > 0]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that has threads
    with concurrent.futures.ProcessPoolExecutor(len(tiers), mp_context=ctx) as pool:
        start_at = time.time() + 3.0  # time for the children to start and import
        futures = [pool.submit(_tier_process, url, cfg, i, tier, rate, start_at) for i, tier, rate in tiers]
        while not all(f.done() for f in futures):
            time.sleep(1.0)
            if progress is not None:
                progress.n = min(progress.total, max(0, round(time.time() - start_at)))  # type: ignore[attr-defined]
                progress.refresh()  # type: ignore[attr-defined]
        return [shot for f in futures for shot in f.result()]


async def _calibrate(url: str, cfg: TiersBenchConfig, seats: int) -> tuple[float, float]:
    """(capacity in requests/s from a closed loop of 2 × seats paid requests, or ``cfg.capacity_rps``
    when given; idle TTFT in s)."""
    async with sse_session(url, 300) as http:
        idle = []
        for p in _prompts(5, cfg, cfg.seed + 999):
            s = await _shot(http, "paid", p, 2)
            if s.ttft is not None:
                idle.append(s.ttft)
        idle_ttft = float(np.median(idle)) if idle else 0.0
        if cfg.capacity_rps is not None:
            return cfg.capacity_rps, idle_ttft
        done = 0
        end = time.perf_counter() + max(8.0, cfg.duration_s / 3)
        prompts = _prompts(4096, cfg, cfg.seed + 7)

        async def worker(w: int) -> None:
            nonlocal done
            i = w
            while time.perf_counter() < end:
                if (await _shot(http, "paid", prompts[i % len(prompts)], cfg.output_len)).status == 200:
                    done += 1
                i += 2 * seats
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(2 * seats)))
        return done / (time.perf_counter() - t0), idle_ttft


def _summarise(name: str, seats: int, rates: dict[str, float], shots: list[Shot], idle_ttft: float,
               engine_log: dict[str, EngineTimes]) -> PhaseResult:
    tiers = {}
    for tier in ("paid", "free"):
        mine = [s for s in shots if s.tier == tier]
        ok = [s for s in mine if s.status == 200 and s.ttft is not None]
        for s in ok:
            if s.request_id in engine_log:
                times = engine_log[s.request_id]
                s.engine_queue, s.engine_ttft, s.engine_to_core = times.queue, times.ttft, times.to_core
        joined = [s for s in ok if s.engine_queue is not None]
        shed: dict[str, int] = {}
        for s in mine:
            if s.status == 429:
                shed[s.code or "429"] = shed.get(s.code or "429", 0) + 1
        waits = [(s.queued or 0.0) + s.engine_queue for s in joined]  # type: ignore[operator]
        ttfts = [s.ttft for s in ok if s.ttft is not None]
        tiers[tier] = TierResult(
            offered=len(mine), admitted=len(ok), shed=shed,
            errors=len([s for s in mine if s.status not in (200, 429) or (s.status == 200 and s.ttft is None)]),
            queue_wait=percentiles(waits), ttft=percentiles(ttfts),
            est_wait=percentiles([s.est_wait for s in ok if s.est_wait is not None]),
            gateway_queue=percentiles([s.queued for s in ok if s.queued is not None]),
            engine_queue=percentiles([s.engine_queue for s in joined]),  # type: ignore[misc]
            engine_ttft=percentiles([s.engine_ttft for s in joined]),  # type: ignore[misc]
            engine_to_core=percentiles([s.engine_to_core for s in joined if s.engine_to_core is not None]),
            ttft_excess=percentiles([max(0.0, t - idle_ttft) for t in ttfts]),
            outside_engine=percentiles([s.ttft - s.engine_ttft for s in joined]),  # type: ignore[operator]
            unmatched=len(ok) - len(joined),
            # The header is whole milliseconds: a shed after < 0.5 ms in the queue counts as at once.
            shed_after_wait=len([s for s in mine if s.status == 429 and (s.queued or 0) > 0]),
            waits=waits, ttfts=ttfts)
    return PhaseResult(name, seats, rates.get("paid", 0.0), rates.get("free", 0.0), tiers)


def _phase(stack: Stack, cfg: TiersBenchConfig, name: str, seats: int, rates: dict[str, float],
           idle_ttft: float, show_progress: bool, round_: int = 1) -> PhaseResult:
    from tqdm import tqdm

    # Round k's arrivals and prompts come from a seed of its own: N rounds are N samples, not one
    # sample N times (round 1 keeps the run's seed, so one round is the run it always was).
    cfg = dataclasses.replace(cfg, seed=cfg.seed + 1000 * (round_ - 1))
    name = name if cfg.rounds == 1 else f"{name} #{round_}"
    with tqdm(total=int(cfg.duration_s), desc=f"W6 {name} ({seats} seats)", unit="s",
              disable=not show_progress, file=sys.stderr) as bar:
        shots = _open_loop(stack.url, cfg, rates, bar)
    return _summarise(name, seats, rates, shots, idle_ttft, read_request_log(stack.engine_log))


def _rounds(stack: Stack, cfg: TiersBenchConfig, seats: int, names: tuple[str, str], rates: dict[str, float],
            idle_ttft: float, show_progress: bool) -> list[PhaseResult]:
    """``cfg.rounds`` alternated pairs of phases: paid alone, then paid with free traffic."""
    phases = []
    for k in range(1, cfg.rounds + 1):
        phases.append(_phase(stack, cfg, names[0], seats, {"paid": rates["paid"]}, idle_ttft, show_progress, k))
        phases.append(_phase(stack, cfg, names[1], seats, rates, idle_ttft, show_progress, k))
    return phases


def run_benchmark(cfg: TiersBenchConfig, model_dir: Path, workdir: Path, show_progress: bool = True) -> dict:
    """Run the calibration and the phases (four per round); returns the report (also the plot's data)."""
    full = cfg.max_num_seqs
    reduced = cfg.reduced_seats
    phases: list[PhaseResult] = []
    with serving_stack(model_dir, full, cfg, workdir) as stack:
        capacity, idle_ttft = asyncio.run(_calibrate(stack.url, cfg, full))
        how = "given (--capacity)" if cfg.capacity_rps is not None else "measured"
        print(f"capacity {capacity:.2f} requests/s with {full} seats ({how}); idle TTFT {idle_ttft * 1000:.1f} ms",
              file=sys.stderr)
        rates = {"paid": cfg.paid_load * capacity, "free": cfg.free_load * capacity}
        phases += _rounds(stack, cfg, full, ("paid-only", "paid+free"), rates, idle_ttft, show_progress)
    with serving_stack(model_dir, reduced, cfg, workdir) as stack:
        removed = f" -{cfg.removed_fraction:.0%}"
        phases += _rounds(stack, cfg, reduced, ("paid-only" + removed, "paid+free" + removed), rates, idle_ttft,
                          show_progress)
    return {"workload": "W6", "config": asdict(cfg), "capacity_rps": capacity, "idle_ttft_s": idle_ttft,
            "phases": phases, "verdicts": paid_verdicts(phases)}


def _ms(seconds: float) -> str:
    """Milliseconds with the precision the figure has: 0.001 ms under 1 ms (engine queue times,
    logged to the microsecond)."""
    if math.isnan(seconds):
        return "–"
    ms = seconds * 1000
    return f"{ms:.3f} ms" if ms < 1 else f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def format_table(report: dict) -> str:
    """A markdown table: one row per phase and tier."""
    rows = ["| phase | seats | tier | offered/s | offered | admitted | shed (429) | queue wait p50 | "
            "queue wait p95 | in gateway queue p95 | in engine queue p95 | engine TTFT p95 | "
            "of which to the core p95 | TTFT p50 | TTFT p95 | TTFT − idle p95 | outside the engine p95 | "
            "shed after queueing |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ph in report["phases"]:
        for tier, t in ph.tiers.items():
            if t.offered == 0:
                continue
            rate = ph.paid_rate if tier == "paid" else ph.free_rate
            shed = ", ".join(f"{n} {c}" for c, n in sorted(t.shed.items())) or "0"
            rows.append(f"| {ph.name} | {ph.seats} | {tier} | {rate:.2f} | {t.offered} | {t.admitted} | {shed} | "
                        f"{_ms(t.queue_wait['p50'])} | {_ms(t.queue_wait['p95'])} | "
                        f"{_ms(t.gateway_queue.get('p95', math.nan))} | {_ms(t.engine_queue.get('p95', math.nan))} | "
                        f"{_ms(t.engine_ttft.get('p95', math.nan))} | {_ms(t.engine_to_core.get('p95', math.nan))} | "
                        f"{_ms(t.ttft['p50'])} | {_ms(t.ttft['p95'])} | "
                        f"{_ms(t.ttft_excess.get('p95', math.nan))} | {_ms(t.outside_engine.get('p95', math.nan))} | "
                        f"{t.shed_after_wait} |")
    return "\n".join(rows)


def plot_waits(report: dict, path: Path) -> None:
    """Per-tier CDFs, full pool and 30% removed: queue wait on top, TTFT at the client below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey=True)
    cfg = report["config"]
    phases = report["phases"]
    half = len(phases) // 2  # the full pool's rounds, then the reduced pool's (as many)
    groups = (phases[:half], phases[half:])
    for row, (attr, label) in enumerate((("waits", "queue wait (s): gateway seat queue + engine queue"),
                                         ("ttfts", "TTFT at the client (s)"))):
        for k, group in enumerate(groups):
            ax = axes[row][k]
            # Each side's rounds pooled into one curve (one round: its phase as it was).
            for mixed in (False, True):
                side = [ph for ph in group if (ph.free_rate > 0) == mixed]
                if not side:
                    continue
                name = side[0].pair_name + (f" ×{len(side)} rounds" if len(side) > 1 else "")
                for tier in ("paid", "free"):
                    values = [v for ph in side for v in getattr(ph.tiers[tier], attr)]
                    if not values:
                        continue
                    xs = np.sort(np.asarray(values))
                    ys = np.arange(1, len(xs) + 1) / len(xs)
                    ax.step(xs, ys, "-" if mixed else "--", where="post", label=f"{tier} ({name})",
                            color="tab:blue" if tier == "paid" else "tab:orange")
            ax.axvline(cfg["paid_budget_s"], color="tab:blue", lw=0.8, ls=":")
            ax.axvline(cfg["free_budget_s"], color="tab:orange", lw=0.8, ls=":")
            ax.set_xscale("symlog", linthresh=0.001 if attr == "waits" else 0.01)
            ax.set_xlim(left=0)
            ax.set_xlabel(label)
            removed = f" ({cfg['removed_fraction']:.0%} of seats removed)" if k else " (full pool)"
            ax.set_title(f"{group[0].seats} seats{removed}")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, loc="lower right")
        axes[row][0].set_ylabel("fraction of admitted requests")
    fig.suptitle(f"W6 per tier: paid {cfg['paid_load']:g}× capacity (budget {cfg['paid_budget_s']:g} s), "
                 f"free {cfg['free_load']:g}× capacity (budget {cfg['free_budget_s']:g} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``bench tiers``."""
    p = bench_subparsers.add_parser(
        "tiers", help="W6: paid and free tiers through the gateway into one shared pool, with shedding.",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="standard model name (tiny, small) or a model directory")
    p.add_argument("--max-num-seqs", type=int, default=8, help="seats of the shared pool's replica (default 8)")
    p.add_argument("--removed-fraction", type=float, default=0.3,
                   help="share of the seats removed for the second pair of phases (default 0.3)")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per phase (default 45)")
    p.add_argument("--paid-load", type=float, default=0.25, help="paid arrival rate as a multiple of capacity "
                   "(default 0.25)")
    p.add_argument("--free-load", type=float, default=3.0, help="free arrival rate as a multiple of capacity "
                   "(default 3)")
    p.add_argument("--capacity", type=float, default=None, metavar="REQ_PER_S",
                   help="take this as the pool's capacity instead of measuring it, so that two builds or "
                        "settings are compared at the same offered rates (a measured capacity moves with the "
                        "machine's load from run to run, and both tiers' rates with it); default: measured")
    p.add_argument("--reserved-seats", type=int, default=2, help="seats of the replica kept for paid; free "
                   "gets the rest (default 2)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the replica's --stream-interval: after the first token, one streamed event per this many "
                        "tokens (default 1: every token); fewer events is less CPU in the replica, the gateway "
                        "and the clients, which share this machine's cores")
    p.add_argument("--free-stream-interval", type=int, default=1,
                   help="the gateway's stream_interval for the free tier: its streams get one event per this "
                        "many tokens (the first token at once), a tiering policy that spends less CPU per free "
                        "token in the replica, the gateway and the clients (default 1: every token, as paid)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request, ignore_eos (default 64)")
    p.add_argument("--seed", type=int, default=0, help="arrival and prompt seed (default 0)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="alternated pairs of paid-only and paid+free phases per seat count, each with arrivals "
                        "of its own seed; the verdict (one per pool) pools the paid TTFTs of every round of each "
                        "side, so it rests on N times the requests and the machine's drift falls on both sides "
                        "(default 1)")
    p.add_argument("--out", type=Path, default=Path("bench-results/w6"), help="output directory for w6.json "
                   "and w6_waits.png (default bench-results/w6)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for the replica's `pagedserve serve` (repeatable), e.g. "
                        "--server-arg=--dtype=float32 on a CPU without native bf16 matmul")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=main)
    return p


def _config_from(args: argparse.Namespace) -> TiersBenchConfig:
    return TiersBenchConfig(model=args.model, max_num_seqs=args.max_num_seqs, removed_fraction=args.removed_fraction,
                            duration_s=args.duration, paid_load=args.paid_load, free_load=args.free_load,
                            reserved_seats=args.reserved_seats, stream_interval=args.stream_interval,
                            free_stream_interval=args.free_stream_interval,
                            prompt_len=args.prompt_len, output_len=args.output_len, seed=args.seed,
                            server_args=tuple(args.server_arg), capacity_rps=args.capacity, rounds=args.rounds)


def main(args: argparse.Namespace) -> int:
    """Run W6 and write its JSON, table and plot."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the results
    try:
        cfg = _config_from(args)
    except ValueError as e:  # a bad flag: one line, not a traceback
        raise SystemExit(f"pagedserve bench tiers: {e}") from None
    if Path(cfg.model).is_dir():
        model_dir = Path(cfg.model)
    else:
        from pagedserve.models.standard import ensure_standard_model

        model_dir = ensure_standard_model(cfg.model)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_benchmark(cfg, model_dir, args.out, show_progress=not args.no_progress)
    out = {**report, "phases": [{**asdict(ph), "tiers": {t: {k: v for k, v in asdict(r).items() if k not in ("waits", "ttfts")}
                                                           for t, r in ph.tiers.items()}}
                                for ph in report["phases"]],
           "verdicts": [{**asdict(v), "ratio": v.ratio, "median_round_ratio": v.median_round_ratio}
                        for v in report["verdicts"]]}
    (args.out / "w6.json").write_text(json.dumps(out, indent=2))
    plot_waits(report, args.out / "w6_waits.png")
    print(format_table(report))
    phases = report["phases"]
    for base, mixed in zip(phases[0::2], phases[1::2]):
        for what, key in (("queue wait", "queue_wait"), ("engine TTFT", "engine_ttft"),
                          ("engine TTFT's part to the core", "engine_to_core"), ("TTFT", "ttft"),
                          ("TTFT − idle", "ttft_excess"), ("TTFT outside the engine", "outside_engine")):
            b, m = getattr(base.tiers["paid"], key)["p95"], getattr(mixed.tiers["paid"], key)["p95"]
            ratio = f"{m / b:.2f}x" if b > 0 else "ratio n/a"
            print(f"{mixed.name}: paid p95 {what} {_ms(m)} with free traffic vs {_ms(b)} without ({ratio}); "
                  f"budget {cfg.paid_budget_s * 1000:.0f} ms")
    for v in report["verdicts"]:
        rounds = ", ".join(f"{r:.2f}" for r in v.round_ratios)
        print(f"verdict, {v.phase} ({v.seats} seats): paid client TTFT p95 with free traffic {_ms(v.with_free_p95)} vs "
              f"{_ms(v.alone_p95)} alone, pooled over {len(v.round_ratios)} round(s): {v.ratio:.2f}x "
              f"(rounds: {rounds}; median {v.median_round_ratio:.2f}x)")
    unmatched = sum(t.unmatched for ph in report["phases"] for t in ph.tiers.values())
    if unmatched:
        print(f"warning: {unmatched} admitted requests had no line in the replica's request log")
    for ph in report["phases"][1::2]:
        free = ph.tiers["free"]
        print(f"{ph.name}: free offered {free.offered}, shed {sum(free.shed.values())} "
              f"({sum(free.shed.values()) / max(1, free.offered):.0%}); a run where little is shed was not "
              f"overloaded (capacity drifted since the calibration)")
    print(f"\nwrote {args.out / 'w6.json'} and {args.out / 'w6_waits.png'}")
    return 0
