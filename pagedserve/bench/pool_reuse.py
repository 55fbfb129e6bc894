"""``pagedserve bench pool-reuse``: W1 run after run on one engine, as a server's KV pool is reused.

Benchmarks that start a fresh engine see a fresh pool: a prompt gets one ascending run of blocks.
A server reuses the blocks finished sequences freed (the free queue gives a run back tail first, so
in descending ids, mixed with other sequences' blocks), and where they lie decides how fast the
decode kernel reads a context (``python examples/paged_decode_bandwidth.py``: blocks in order 1.5x
as fast as the same runs backwards, 1.8x as fast as scattered ones, on a Zen 5). This runs W1 again
and again on one engine, its token ids shifted each run so that no prompt hits the prefix cache,
with a pool that holds one run and not two (from the second run on, prompts take blocks earlier
runs freed) and every page of it faulted in first (no run pays first-touch page faults). Per run:
output tokens/s against the first run's, and how the running sequences' block tables lie: the
share of neighbouring blocks whose ids ascend by one, and descend by one. After the last run every
block must be free again (else the run stops: a leak is a bug)."""

from __future__ import annotations

import argparse
import statistics

from pagedserve.bench.common import machine_summary, resolve_model, write_result
from pagedserve.config import parse_bytes

# Running sequences from which a step's tables are counted: W1's full batch, not its tail.
COUNT_FROM_RUNNING = 48


def memory_size(value: str) -> str:
    """``--kv-cache-memory``: a size the engine's config reads (``512MiB``, a byte count)."""
    try:
        parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_parser(bench) -> None:
    p = bench.add_parser("pool-reuse", help="W1 run after run on one engine: rate and block order as a pool is reused",
                         description="Runs W1 again and again on one engine (new token ids each run, a KV pool that "
                                     "holds one run, faulted in first); prints each run's output tokens/s against "
                                     "the first run's and how the block tables lie (neighbouring block ids "
                                     "ascending / descending by one).")
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--runs", type=int, default=8, help="W1 runs on the one engine (default 8)")
    p.add_argument("--kv-cache-memory", type=memory_size, default="512MiB",
                   help="the KV pool (default 512MiB: small's W1 peaks at ~1,750 of its 2,730 blocks)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def neighbours(block_manager, seq_ids) -> tuple[int, int, int]:
    """Over the tables of ``seq_ids``: neighbouring block pairs whose ids ascend by one, descend by
    one, and all pairs."""
    up = down = pairs = 0
    for seq_id in seq_ids:
        ids = block_manager.block_ids(seq_id)
        up += sum(b - a == 1 for a, b in zip(ids, ids[1:]))
        down += sum(a - b == 1 for a, b in zip(ids, ids[1:]))
        pairs += max(0, len(ids) - 1)
    return up, down, pairs


def w1_runs(model: str, runs: int, kv_cache_memory: str) -> list[dict]:
    """Per run: output tokens/s, and the block pairs of the running tables counted over the steps
    where at least :data:`COUNT_FROM_RUNNING` sequences run."""
    from pagedserve.bench.compare import timed_run
    from pagedserve.bench.workloads import w1_offline
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    engine = Engine(EngineConfig(model=resolve_model(model), kv_cache_memory=kv_cache_memory))
    try:
        for k_cache, v_cache in engine.core.runner.kv_caches:
            for pool in (k_cache.data, v_cache.data):
                pool.zero_()  # every page committed, as in a server that has run a while
        vocab = engine.core.arch.vocab_size
        requests = w1_offline(vocab_size=vocab)
        outputs = [r.output_len for r in requests]
        timed_run(engine, [r.prompt_token_ids for r in requests[:8]], [4] * 8)  # warm-up, as w1_rate's
        scheduler, step = engine.core.scheduler, engine.core.step
        results = []
        for run in range(runs):
            # W1's lengths every run, its token ids shifted: no prefix hits
            prompts = [[(t + 7 * (run + 1)) % vocab for t in r.prompt_token_ids] for r in requests]
            counts = [0, 0, 0]

            def counted_step():
                step_outputs = step()
                if len(scheduler.running) >= COUNT_FROM_RUNNING:
                    seen = neighbours(scheduler.block_manager, [seq.seq_id for seq in scheduler.running])
                    counts[:] = [a + b for a, b in zip(counts, seen)]
                return step_outputs

            engine.core.step = counted_step
            try:
                t = timed_run(engine, prompts, outputs)
            finally:
                engine.core.step = step
            results.append({"tok_s": sum(outputs) / (t.first_s + t.gen_s),
                            "ascending": counts[0] / max(1, counts[2]), "descending": counts[1] / max(1, counts[2])})
        held = scheduler.block_manager.num_used_blocks
        if held:
            raise SystemExit(f"{held} KV blocks still held after every request ended: a leak, report it")
    finally:
        engine.close()
    return results


def run(args: argparse.Namespace) -> int:
    if args.runs < 2:
        raise SystemExit("--runs must be >= 2: the first run is the fresh pool the others are compared with")
    runs = w1_runs(args.model, args.runs, args.kv_cache_memory)
    first = runs[0]["tok_s"]
    print(f"\nW1 on one engine ({args.model}, {machine_summary()}), run after run, new token ids each time:")
    for i, r in enumerate(runs, 1):
        print(f"  run {i}: {r['tok_s']:7.1f} output tok/s ({r['tok_s'] / first:.2f}x run 1); "
              f"neighbouring blocks ascending {r['ascending']:.2f}, descending {r['descending']:.2f}")
    later = statistics.median(r["tok_s"] for r in runs[1:]) / first
    print(f"  runs 2-{len(runs)}: median {later:.3f}x run 1")
    write_result(args.json_out, {"benchmark": "pool-reuse", "model": args.model, "runs": runs, "later_ratio": later})
    return 0
