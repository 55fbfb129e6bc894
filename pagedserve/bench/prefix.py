"""W5 shared prefix: time to first token of a request whose 1,024-token prefix is cached."""

from __future__ import annotations

import argparse
import time

from pagedserve.bench.common import machine_summary, median, resolve_model, write_result
from pagedserve.bench.workloads import w5_shared_prefix


def add_parser(bench) -> None:
    p = bench.add_parser("prefix", help="W5: TTFT of a prefix-cache hit against a cold request",
                         description="W5 of docs/WORKLOADS.md: two requests share a 1,024-token prefix, each with a 32-token "
                                     "suffix and 16 output tokens, sent one after the other. Reports the second "
                                     "request's time to first token against the first's (cold) and the prefix-cache "
                                     "hit count.")
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--repeats", type=int, default=5, help="cold/warm pairs to run (median reported)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def ttft(engine, request_id: str, prompt: list[int], max_tokens: int) -> float:
    from pagedserve.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
    return first


def run(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    engine = Engine(EngineConfig(model=resolve_model(args.model), kv_cache_memory="512MiB"))
    cold, warm, hits = [], [], []
    ttft(engine, "warmup", w5_shared_prefix(seed=99)[0].prompt_token_ids, 2)
    for i in range(args.repeats):
        first, second = w5_shared_prefix(seed=i)
        engine.core.block_manager.reset_prefix_cache()
        before = engine.core.block_manager.prefix_hit_tokens
        cold.append(ttft(engine, f"cold{i}", first.prompt_token_ids, first.output_len))
        warm.append(ttft(engine, f"warm{i}", second.prompt_token_ids, second.output_len))
        hits.append(engine.core.block_manager.prefix_hit_tokens - before)
    ratio = median(warm) / median(cold)
    print(f"\nW5 on {args.model} ({machine_summary()}), median of {args.repeats}:")
    print(f"  first request (cold)  TTFT {median(cold) * 1e3:8.1f} ms")
    print(f"  second (prefix hit)   TTFT {median(warm) * 1e3:8.1f} ms   hit tokens {hits[0]} "
          f"(1,024-token prefix = {1024 // 16} full blocks x 16)")
    print(f"  ratio warm / cold: {ratio:.3f}x")
    write_result(args.json_out, {"workload": "W5", "model": args.model, "cold_ttft_s": cold, "warm_ttft_s": warm,
                                 "hit_tokens": hits, "ratio": ratio})
    return 0
