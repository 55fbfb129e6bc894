"""``pagedserve bench tiers``: workload W6 (BENCH.md) — paid and free traffic through the gateway.

One shared pool of engine replicas; paid (priority 0, queue-wait budget 1 s) and free (priority
10, budget 5 s) keys. Phases, each ``--duration`` seconds of Poisson arrivals, every request
streamed:

1. calibrate: a closed loop of 2 × seats paid requests measures the pool's capacity C (requests/s)
   and an idle request's TTFT;
2. ``paid-only``: paid at ``--paid-load`` × C (0.25 by default), no free traffic (the reference);
3. ``paid+free``: the same paid traffic plus free at ``--free-load`` × C (3 × by default);
4. and 5. the same two with 30% of the pool's seats removed (``--max-num-seqs`` × 0.7), same
   offered rates.

Per tier: offered, admitted, shed (429, by error code), queue wait p50/p95 and TTFT p95. The
client cannot see inside the engine, so *queue wait* = TTFT − the idle TTFT (prefill and transport
of an unqueued request), floored at 0. Writes ``w6.json`` and ``w6_waits.png`` (per-tier wait
distributions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from pagedserve.bench.processes import free_port, running_process

PAID_KEY, FREE_KEY = "sk-w6-paid", "sk-w6-free"


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
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 2 or not 0 < self.removed_fraction < 1:
            raise ValueError("max_num_seqs must be >= 2 and removed_fraction in (0, 1)")
        if self.duration_s <= 0 or self.paid_load <= 0 or self.free_load < 0:
            raise ValueError("duration_s and paid_load must be > 0, free_load >= 0")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")


@dataclass
class Shot:
    """One request as the client saw it."""

    tier: str
    status: int = 0
    code: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    est_wait: float | None = None  # the gateway's estimate at admission (x-pagedserve-est-queue-wait-ms)


@dataclass
class TierResult:
    """Per-tier figures of one phase (waits and TTFT in seconds)."""

    offered: int
    admitted: int
    shed: dict[str, int]
    errors: int
    queue_wait: dict[str, float]
    ttft: dict[str, float]
    est_wait: dict[str, float]  # the gateway's own estimates at admission, for comparison
    waits: list[float] = field(default_factory=list, repr=False)


@dataclass
class PhaseResult:
    """One phase: its offered rates and each tier's result."""

    name: str
    seats: int
    paid_rate: float
    free_rate: float
    tiers: dict[str, TierResult]


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p95": math.nan}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95))}


def gateway_toml(engine_urls: list[str], cfg: TiersBenchConfig, port: int) -> str:
    """The gateway config of the run: one shared pool, paid outranks free."""
    replicas = ", ".join(f'"{u}"' for u in engine_urls)
    big = 10_000_000  # the buckets are not what W6 measures: shedding by queue wait is
    return f"""
[gateway]
port = {port}
load_poll_interval_s = 0.1
default_service_s = 1.0

[pools.shared]
replicas = [{replicas}]

[tiers.paid]
token_rate = {big}
token_burst = {big}
pools = ["shared"]
priority = 0
max_queue_wait_s = {cfg.paid_budget_s}
bucket = "tier"

[tiers.free]
token_rate = {big}
token_burst = {big}
pools = ["shared"]
priority = 10
max_queue_wait_s = {cfg.free_budget_s}
bucket = "tier"

[keys]
"{PAID_KEY}" = "paid"
"{FREE_KEY}" = "free"
"""


@contextmanager
def serving_stack(model_dir: Path, seats: int, cfg: TiersBenchConfig, workdir: Path) -> Iterator[str]:
    """An engine replica with ``seats`` seats behind a gateway subprocess; yields the gateway URL."""
    eport, gport = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{eport}"
    engine = [sys.executable, "-m", "pagedserve", "serve", "--model",
              str(model_dir), "--host", "127.0.0.1", "--port", str(eport), "--max-num-seqs", str(seats),
              "--served-model-name", "w6"]
    with running_process(engine, f"{engine_url}/health"):
        toml = workdir / f"gateway-{seats}.toml"
        toml.write_text(gateway_toml([engine_url], cfg, gport))
        gateway = [sys.executable, "-m", "pagedserve.gateway", "--config", str(toml)]
        with running_process(gateway, f"http://127.0.0.1:{gport}/health"):
            yield f"http://127.0.0.1:{gport}"


async def _shot(http: httpx.AsyncClient, tier: str, prompt: list[int], output_len: int) -> Shot:
    key = PAID_KEY if tier == "paid" else FREE_KEY
    body = {"model": "w6", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    shot = Shot(tier)
    start = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            shot.status = r.status_code
            if "x-pagedserve-est-queue-wait-ms" in r.headers:
                shot.est_wait = float(r.headers["x-pagedserve-est-queue-wait-ms"]) / 1000
            if r.status_code != 200:
                try:
                    shot.code = json.loads(await r.aread())["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    shot.code = f"http_{r.status_code}"
                return shot
            async for line in r.aiter_lines():
                if shot.ttft is None and line.startswith("data: {"):
                    shot.ttft = time.perf_counter() - start
        shot.e2e = time.perf_counter() - start
    except httpx.HTTPError as e:
        shot.code = type(e).__name__
    return shot


def _prompts(n: int, cfg: TiersBenchConfig, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 31000, size=cfg.prompt_len).tolist() for _ in range(n)]


async def _open_loop(url: str, cfg: TiersBenchConfig, rates: dict[str, float], progress: object | None) -> list[Shot]:
    """Poisson arrivals per tier for ``duration_s``; every request streamed; all awaited."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        t0 = time.perf_counter()
        tasks = []
        for i, (tier, rate) in enumerate(rates.items()):
            if rate <= 0:
                continue
            rng = np.random.default_rng(cfg.seed + 17 * i)
            offsets = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * cfg.duration_s * 1.5) + 10))
            offsets = offsets[offsets < cfg.duration_s]
            prompts = _prompts(len(offsets), cfg, cfg.seed + 101 * (i + 1))

            async def launch(offset: float, prompt: list[int], tier: str = tier) -> Shot:
                await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
                shot = await _shot(http, tier, prompt, cfg.output_len)
                if progress is not None:
                    progress.update(1)  # type: ignore[attr-defined]
                return shot
            tasks += [launch(float(o), p) for o, p in zip(offsets, prompts)]
        return list(await asyncio.gather(*tasks))


async def _calibrate(url: str, cfg: TiersBenchConfig, seats: int) -> tuple[float, float]:
    """(capacity in requests/s from a closed loop of 2 × seats paid requests, idle TTFT in s)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        idle = []
        for p in _prompts(5, cfg, cfg.seed + 999):
            s = await _shot(http, "paid", p, 2)
            if s.ttft is not None:
                idle.append(s.ttft)
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
        return done / (time.perf_counter() - t0), float(np.median(idle)) if idle else 0.0


def _summarise(name: str, seats: int, rates: dict[str, float], shots: list[Shot], idle_ttft: float) -> PhaseResult:
    tiers = {}
    for tier in ("paid", "free"):
        mine = [s for s in shots if s.tier == tier]
        ok = [s for s in mine if s.status == 200 and s.ttft is not None]
        shed: dict[str, int] = {}
        for s in mine:
            if s.status == 429:
                shed[s.code or "429"] = shed.get(s.code or "429", 0) + 1
        waits = [max(0.0, s.ttft - idle_ttft) for s in ok if s.ttft is not None]
        tiers[tier] = TierResult(
            offered=len(mine), admitted=len(ok), shed=shed,
            errors=len([s for s in mine if s.status not in (200, 429) or (s.status == 200 and s.ttft is None)]),
            queue_wait=_pcts(waits), ttft=_pcts([s.ttft for s in ok if s.ttft is not None]),
            est_wait=_pcts([s.est_wait for s in ok if s.est_wait is not None]), waits=waits)
    return PhaseResult(name, seats, rates.get("paid", 0.0), rates.get("free", 0.0), tiers)


def run_benchmark(cfg: TiersBenchConfig, model_dir: Path, workdir: Path, show_progress: bool = True) -> dict:
    """Run the calibration and the four phases; returns the report (also the plot's data)."""
    from tqdm import tqdm

    full = cfg.max_num_seqs
    reduced = max(1, round(full * (1 - cfg.removed_fraction)))
    phases: list[PhaseResult] = []
    with serving_stack(model_dir, full, cfg, workdir) as url:
        capacity, idle_ttft = asyncio.run(_calibrate(url, cfg, full))
        print(f"capacity {capacity:.2f} requests/s with {full} seats; idle TTFT {idle_ttft * 1000:.1f} ms",
              file=sys.stderr)
        rates = {"paid": cfg.paid_load * capacity, "free": cfg.free_load * capacity}
        for name, r in (("paid-only", {"paid": rates["paid"]}), ("paid+free", rates)):
            with tqdm(total=int(sum(r.values()) * cfg.duration_s), desc=f"W6 {name} ({full} seats)",
                      disable=not show_progress, file=sys.stderr) as bar:
                phases.append(_summarise(name, full, r, asyncio.run(_open_loop(url, cfg, r, bar)), idle_ttft))
    with serving_stack(model_dir, reduced, cfg, workdir) as url:
        for name, r in ((f"paid-only -{cfg.removed_fraction:.0%}", {"paid": rates["paid"]}),
                        (f"paid+free -{cfg.removed_fraction:.0%}", rates)):
            with tqdm(total=int(sum(r.values()) * cfg.duration_s), desc=f"W6 {name} ({reduced} seats)",
                      disable=not show_progress, file=sys.stderr) as bar:
                phases.append(_summarise(name, reduced, r, asyncio.run(_open_loop(url, cfg, r, bar)), idle_ttft))
    return {"workload": "W6", "config": asdict(cfg), "capacity_rps": capacity, "idle_ttft_s": idle_ttft,
            "phases": phases}


def format_table(report: dict) -> str:
    """A markdown table: one row per phase and tier."""
    rows = ["| phase | seats | tier | offered/s | offered | admitted | shed (429) | queue wait p50 | "
            "queue wait p95 | TTFT p95 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for ph in report["phases"]:
        for tier, t in ph.tiers.items():
            if t.offered == 0:
                continue
            rate = ph.paid_rate if tier == "paid" else ph.free_rate
            shed = ", ".join(f"{n} {c}" for c, n in sorted(t.shed.items())) or "0"
            rows.append(f"| {ph.name} | {ph.seats} | {tier} | {rate:.2f} | {t.offered} | {t.admitted} | {shed} | "
                        f"{t.queue_wait['p50'] * 1000:.0f} ms | {t.queue_wait['p95'] * 1000:.0f} ms | "
                        f"{t.ttft['p95'] * 1000:.0f} ms |")
    return "\n".join(rows)


def plot_waits(report: dict, path: Path) -> None:
    """CDFs of queue wait per tier and phase: full pool on the left, 30% removed on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    cfg = report["config"]
    for k, (ax, group) in enumerate(zip(axes, (report["phases"][:2], report["phases"][2:]))):
        for ph in group:
            for tier, t in ph.tiers.items():
                if not t.waits:
                    continue
                xs = np.sort(np.asarray(t.waits))
                ys = np.arange(1, len(xs) + 1) / len(xs)
                style = "-" if "free" in ph.name else "--"
                ax.step(xs, ys, style, where="post", label=f"{tier} ({ph.name})",
                        color="tab:blue" if tier == "paid" else "tab:orange")
        ax.axvline(cfg["paid_budget_s"], color="tab:blue", lw=0.8, ls=":")
        ax.axvline(cfg["free_budget_s"], color="tab:orange", lw=0.8, ls=":")
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlim(left=0)
        ax.set_xlabel("queue wait (s) = TTFT − idle TTFT")
        removed = f" ({cfg['removed_fraction']:.0%} of seats removed)" if k else " (full pool)"
        ax.set_title(f"{group[0].seats} seats{removed}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("fraction of admitted requests")
    fig.suptitle(f"W6: per-tier queue wait; paid {cfg['paid_load']:g}× capacity (budget {cfg['paid_budget_s']:g} s), "
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
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request, ignore_eos (default 64)")
    p.add_argument("--seed", type=int, default=0, help="arrival and prompt seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("bench-results/w6"), help="output directory for w6.json "
                   "and w6_waits.png (default bench-results/w6)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run W6 and write its JSON, table and plot."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the results
    cfg = TiersBenchConfig(model=args.model, max_num_seqs=args.max_num_seqs, removed_fraction=args.removed_fraction,
                           duration_s=args.duration, paid_load=args.paid_load, free_load=args.free_load,
                           prompt_len=args.prompt_len, output_len=args.output_len, seed=args.seed)
    if Path(cfg.model).is_dir():
        model_dir = Path(cfg.model)
    else:
        from pagedserve.models.standard import ensure_standard_model

        model_dir = ensure_standard_model(cfg.model)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run_benchmark(cfg, model_dir, args.out, show_progress=not args.no_progress)
    out = {**report, "phases": [{**asdict(ph), "tiers": {t: {k: v for k, v in asdict(r).items() if k != "waits"}
                                                           for t, r in ph.tiers.items()}}
                                for ph in report["phases"]]}
    (args.out / "w6.json").write_text(json.dumps(out, indent=2))
    plot_waits(report, args.out / "w6_waits.png")
    print(format_table(report))
    paid = {ph.name: ph.tiers["paid"].queue_wait["p95"] for ph in report["phases"]}
    names = [ph.name for ph in report["phases"]]
    for base, mixed in ((names[0], names[1]), (names[2], names[3])):
        ratio = f"{paid[mixed] / paid[base]:.2f}x" if paid[base] > 0 else "ratio n/a"
        print(f"paid p95 queue wait: {paid[mixed] * 1000:.0f} ms with free traffic vs {paid[base] * 1000:.0f} ms "
              f"without ({ratio}); budget {cfg.paid_budget_s * 1000:.0f} ms")
    for ph in report["phases"][1::2]:
        free = ph.tiers["free"]
        print(f"{ph.name}: free offered {free.offered}, shed {sum(free.shed.values())} "
              f"({sum(free.shed.values()) / max(1, free.offered):.0%}); a run where little is shed was not "
              f"overloaded (capacity drifted since the calibration)")
    print(f"\nwrote {args.out / 'w6.json'} and {args.out / 'w6_waits.png'}")
    return 0
