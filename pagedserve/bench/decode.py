"""W2 single stream: decode tokens/s of one request (16-token prompt, 256 output tokens)."""

from __future__ import annotations

import argparse

from pagedserve.bench.common import greedy_stream, machine_summary, median, resolve_model, write_result
from pagedserve.bench.workloads import w2_single_stream


def add_parser(bench) -> None:
    p = bench.add_parser("decode", help="W2: single-stream decode tokens/s",
                         description="W2 of docs/WORKLOADS.md: one request, 16-token prompt, 256 output tokens, greedy. "
                                     "Reports decode tokens/s (after the first token) over several runs.")
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (median reported)")
    p.add_argument("--dtype", default="auto", help="model dtype (auto = the checkpoint's)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def decode_rate(engine, req) -> float:
    return greedy_stream(engine, req.prompt_token_ids, req.output_len)[0]


def run(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    engine = Engine(EngineConfig(model=resolve_model(args.model), dtype=args.dtype, kv_cache_memory="256MiB"))
    req = w2_single_stream()
    decode_rate(engine, req)
    rates = [decode_rate(engine, req) for _ in range(args.repeats)]
    print(f"\nW2 on {args.model} ({engine.core.dtype}, {machine_summary()}): "
          f"{median(rates):.1f} decode tokens/s (median of {args.repeats}: {', '.join(f'{r:.1f}' for r in rates)})")
    write_result(args.json_out, {"workload": "W2", "model": args.model, "dtype": str(engine.core.dtype),
                                 "decode_tok_s": rates})
    return 0
