"""``pagedserve plan …`` and ``pagedserve simulate``: the planner's command line.

``add_parser(subparsers)`` registers both; each command prints a table, or JSON with ``--json``,
and some draw a PNG with ``--plot FILE``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from pagedserve.planner import commands
from pagedserve.planner.report import dumps
from pagedserve.planner.sizing import KV_ELEMENT_BYTES, WEIGHT_ELEMENT_BYTES

EXAMPLES_PLAN = """examples:
  pagedserve plan kv --layers 40 --kv-heads 8 --head-dim 128 --context 4096 --users 10
  pagedserve plan seats --layers 40 --kv-heads 8 --head-dim 128 --free-memory 9GiB --mean-len 1200
  pagedserve plan weights --params 8B --group-size 128 --card-memory 80GB
  pagedserve plan decode --params 8B --weights-dtype int4 --bandwidth 1008GB/s
  pagedserve plan prefill --model small --prompt-tokens 512 2048 --flops 100T
  pagedserve plan bucket --rate 100 --burst 500 --window 60s --offered-rate 300
  pagedserve plan queue --from-waits 97ms 850ms --loss 0.3
  pagedserve plan queue --arrival-rate 80 --service-time 100ms --servers 10 --loss 0.3 --plot wait.png
  pagedserve plan shed --arrival-rate 90 --service-time 100ms --servers 10 --target-wait 200ms --percentile 0.95
"""


def add_parser(subparsers: argparse._SubParsersAction) -> dict[str, argparse._SubParsersAction]:
    """Register ``plan`` (with its sub-commands) and ``simulate`` on the top-level CLI; return
    ``plan``'s sub-command list, to which ``plan check`` is added by the part that runs the engine
    (pagedserve.bench.plan_check: the planner is arithmetic and imports nothing that runs a model)."""
    plan = subparsers.add_parser(
        "plan", help="capacity arithmetic: KV, seats, weights, decode, prefill, bucket, queue, shed, check",
        description="Answer sizing questions from a model's shape and a card's memory and bandwidth.",
        epilog=EXAMPLES_PLAN, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_sub = plan.add_subparsers(dest="plan_command", metavar="QUESTION", required=True)

    kv = _sub(plan_sub, "kv", "KV bytes per token, per request and for N users, per KV precision", commands.run_kv)
    _shape_args(kv)
    kv.add_argument("--kv-dtype", action="append", choices=sorted(KV_ELEMENT_BYTES),
                    help="KV precision to show (repeatable; default bf16, fp8, int8 and int4)")
    kv.add_argument("--context", type=int, default=4096, help="context length per request in tokens (default 4096)")
    kv.add_argument("--users", type=int, default=1, help="concurrent requests to total up (default 1)")
    _output_args(kv, plot="KV per request against context length, per KV precision")

    seats = _sub(plan_sub, "seats", "seats a KV budget holds: worst-case reservation vs paging", commands.run_seats)
    _shape_args(seats)
    _memory_args(seats)
    seats.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_ELEMENT_BYTES), help="KV precision (default bf16)")
    seats.add_argument("--max-model-len", "--context", type=int, default=4096, dest="max_model_len",
                       help="tokens a worst-case server reserves per request (default 4096)")
    seats.add_argument("--mean-len", type=int, default=None,
                       help="mean final length (prompt + output) of requests, for paging (default: max len)")
    seats.add_argument("--block-size", type=int, default=16, help="tokens per KV block under paging (default 16)")
    seats.add_argument("--users", type=int, default=None,
                       help="requests to total the reservation for (default: the worst-case seats)")
    _output_args(seats, plot="worst-case seats against context length, per KV precision")

    weights = _sub(plan_sub, "weights", "weight bytes per precision, and memory left for KV on a card",
                   commands.run_weights)
    _params_args(weights)
    weights.add_argument("--weights-dtype", action="append", choices=sorted(WEIGHT_ELEMENT_BYTES),
                         help="precision to show (repeatable; default bf16, int8, int4)")
    _scale_args(weights)
    weights.add_argument("--card-memory", help="card memory, e.g. 80GB or 24GiB: show what is left for KV")
    weights.add_argument("--overhead", default="0", help="memory for activations, CUDA context, ... (default 0)")
    weights.add_argument("--memory-fraction", type=float, default=1.0,
                         help="fraction of card memory the server may use (default 1.0)")
    _output_args(weights)

    decode = _sub(plan_sub, "decode", "decode tokens/s per stream: bandwidth ÷ bytes read per step",
                  commands.run_decode)
    _shape_args(decode)
    decode.add_argument("--bandwidth", required=True, help="memory bandwidth, e.g. 1008GB/s or 3.35TB/s")
    decode.add_argument("--weights-dtype", action="append", choices=sorted(WEIGHT_ELEMENT_BYTES),
                        help="weight precision (repeatable; default bf16, int8, int4)")
    _scale_args(decode)
    decode.add_argument("--context", type=int, default=0,
                        help="tokens of KV each stream reads per step (default 0: weights only)")
    decode.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_ELEMENT_BYTES), help="KV precision (default bf16)")
    decode.add_argument("--batch", type=int, default=1, help="streams decoded together per step (default 1)")
    _output_args(decode)

    prefill = _sub(plan_sub, "prefill", "prefill seconds ≈ 2 × params × prompt tokens ÷ FLOP/s", commands.run_prefill)
    _params_args(prefill)
    prefill.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048], help="prompt lengths (default 2048)")
    prefill.add_argument("--flops", required=True, help="achieved FLOP/s, e.g. 400T or 4e14")
    _output_args(prefill)

    bucket = _sub(plan_sub, "bucket", "tokens a token bucket admits over a window", commands.run_bucket)
    bucket.add_argument("--rate", type=float, required=True, help="refill rate, tokens/s")
    bucket.add_argument("--burst", type=float, required=True, help="bucket capacity, tokens (it starts full)")
    bucket.add_argument("--window", default="60s", help="how long traffic is offered (default 60s)")
    bucket.add_argument("--offered-rate", type=float, required=True, help="tokens/s offered on average")
    bucket.add_argument("--pattern", default="steady", choices=["steady", "burst", "periodic"],
                        help="steady stream (also Poisson's mean), one burst at the start, or periodic bursts")
    bucket.add_argument("--period", help="seconds between bursts for --pattern periodic, e.g. 10s")
    bucket.add_argument("--cost", type=float, help="tokens per request: also count whole requests")
    _output_args(bucket)

    queue = _sub(plan_sub, "queue", "mean and p95 queue wait; priority tiers; capacity loss", commands.run_queue)
    _pool_args(queue, required=False)
    queue.add_argument("--service-cv", type=float,
                       help="service time std ÷ mean with --servers 1: M/G/1 (default: exponential, cv 1)")
    queue.add_argument("--percentile", type=float, default=0.95, help="tail to report (default 0.95)")
    queue.add_argument("--loss", type=float, help="fraction of capacity removed, e.g. 0.3: show the wait after")
    queue.add_argument("--from-waits", nargs=2, metavar=("BEFORE", "AFTER"),
                       help="solve an M/M/1 pool from its mean wait before and after --loss, e.g. 97ms 850ms")
    queue.add_argument("--tier-rates", type=float, nargs="+",
                       help="arrivals/s of priority tiers sharing the pool, highest priority first")
    _output_args(queue, plot="wait against utilization, the current point marked")

    shed = _sub(plan_sub, "shed", "arrivals/s to shed to reach a target utilization or wait", commands.run_shed)
    _pool_args(shed, required=True)
    shed.add_argument("--target-utilization", type=float, help="utilization to bring the pool back to, e.g. 0.8")
    shed.add_argument("--target-wait", help="wait to bring the pool back to, e.g. 200ms")
    shed.add_argument("--percentile", type=float,
                      help="with --target-wait: hold this percentile of the wait (default: the mean)")
    _output_args(shed)

    simulate = subparsers.add_parser(
        "simulate", help="discrete-event run of tiers and pools, to check the queueing formulas",
        description="Poisson (or trace) arrivals of tiers into pools of seats, with priority, a token bucket "
                    "and shedding; per-tier wait p50/p95/p99, admitted, shed and utilization. Seeded.",
        epilog="examples:\n  pagedserve simulate --servers 4 --service-time 50ms --arrival-rate 72 --requests 1000000\n"
               "  pagedserve simulate --servers 8 --service-time 50ms --tier paid:40,priority=0 "
               "--tier free:100,priority=1,wait_budget=250ms\n  pagedserve simulate --config sim.toml --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate.add_argument("--config", help="TOML file with [[pools]] and [[tiers]] tables (see docs/PLANNER.md)")
    simulate.add_argument("--servers", type=int, default=1, help="seats in the pool (default 1)")
    simulate.add_argument("--service-time", default="50ms", help="mean service time (default 50ms)")
    simulate.add_argument("--service-dist", default="exp", choices=["exp", "det", "lognormal", "gamma"],
                          help="service time distribution (default exp)")
    simulate.add_argument("--service-cv", type=float, help="std ÷ mean for lognormal and gamma (default 1)")
    simulate.add_argument("--arrival-rate", type=float,
                          help="arrivals/s of a single tier when no --tier is given (default: utilization 0.8)")
    simulate.add_argument("--tier", action="append",
                          help="NAME:RATE[,priority=P,bucket_rate=R,bucket_burst=B,cost=C,wait_budget=250ms] "
                               "(repeatable; lower priority is served first)")
    simulate.add_argument("--trace", help="CSV of arrivals: time,tier[,service_time][,cost] instead of Poisson")
    simulate.add_argument("--requests", type=int, default=200_000, help="Poisson arrivals to simulate (default 200000)")
    simulate.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    simulate.add_argument("--warmup", type=float, default=0.05,
                          help="share of earliest arrivals left out of wait statistics (default 0.05)")
    _output_args(simulate, plot="per-tier wait percentiles")
    simulate.set_defaults(func=_wrap(commands.run_simulate))
    return {"plan": plan_sub}


def _sub(plan_sub: argparse._SubParsersAction, name: str, help_text: str,
         body: Callable[[argparse.Namespace], commands.Report]) -> argparse.ArgumentParser:
    parser = plan_sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
    parser.set_defaults(func=_wrap(body))
    return parser


def _wrap(body: Callable[[argparse.Namespace], commands.Report]) -> Callable[[argparse.Namespace], int]:
    """Run a command body: print its table or JSON; a bad input is one clear line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            text, payload = body(args)
        except (ValueError, KeyError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(dumps(payload) if args.json else text)
        if getattr(args, "plot", None) and not args.json:
            print(f"\nchart written to {args.plot}")
        return 0

    return run


def _shape_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model shape (--model, or the three numbers)")
    group.add_argument("--model", help="standard model name (tiny, small, qwen05-shape), config.json, model dir or hub id")
    group.add_argument("--layers", type=int, help="decoder layers")
    group.add_argument("--kv-heads", type=int, help="KV heads (GQA groups)")
    group.add_argument("--head-dim", type=int, help="dimensions per head")
    group.add_argument("--params", help="parameter count, e.g. 8B or 7.6e9 (overrides the count from --model)")


def _params_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model size")
    group.add_argument("--params", help="parameter count, e.g. 8B or 7.6e9")
    group.add_argument("--model", help="or: standard model name, config.json, model dir or hub id to count them from")


def _scale_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group-size", type=int,
                        help="quantization group size: add one scale per group for 8- and 4-bit weights")
    parser.add_argument("--scale-bytes", type=float, default=2.0, help="bytes per scale (default 2, a bf16 scale)")


def _memory_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV budget (--free-memory, or a card minus weights)")
    group.add_argument("--free-memory", help="memory for the KV cache, e.g. 9GiB")
    group.add_argument("--card-memory", help="card memory, e.g. 80GB: the KV budget is what the weights leave")
    group.add_argument("--weights-dtype", default="bf16", choices=sorted(WEIGHT_ELEMENT_BYTES),
                       help="weight precision with --card-memory (default bf16)")
    group.add_argument("--overhead", default="0", help="activations, CUDA context, ... with --card-memory (default 0)")
    group.add_argument("--memory-fraction", type=float, default=1.0,
                       help="fraction of the card the server may use (default 1.0)")


def _pool_args(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--arrival-rate", type=float, required=required, help="arrivals per second")
    parser.add_argument("--service-time", required=required, help="mean time a request holds a seat, e.g. 100ms")
    parser.add_argument("--servers", type=int, default=1, help="seats in the pool (default 1)")


def _output_args(parser: argparse.ArgumentParser, plot: str | None = None) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    if plot:
        parser.add_argument("--plot", metavar="FILE.png", help=f"also draw a PNG chart: {plot}")
