"""W3 seats at fixed KV memory: the paged engine against worst-case reservation, one run each."""

from __future__ import annotations

import argparse

from tqdm.auto import tqdm

from pagedserve.bench.common import machine_summary, write_result
from pagedserve.bench.workloads import w3_seats


def add_parser(bench) -> None:
    p = bench.add_parser("seats", help="W3: concurrent requests and KV utilization, paged vs worst-case reservation",
                         description="W3 of docs/WORKLOADS.md: max_model_len 4096, a KV budget that worst-case reservation "
                                     "fills with 8 requests (8 x 4096 x KV bytes/token), 64 requests offered at "
                                     "once. Runs the same engine with paged blocks and with max_model_len reserved "
                                     "per request, and reports peak / mean running requests and KV utilization.")
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--num-requests", type=int, default=64, help="requests offered at once (W3: 64)")
    p.add_argument("--naive-seats", type=int, default=8, help="requests worst-case reservation fits in the budget")
    p.add_argument("--max-model-len", type=int, default=4096, help="context limit reserved per request by the naive mode")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop each run after this many engine steps (default: run every request to the end)")
    p.add_argument("--plot", default=None, help="write a PNG of running requests and KV utilization over time")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def _sample(engine, t):
    st = engine.stats()
    return (t, st.num_running, st.kv_utilization, st.kv_blocks_used)


def measure(model_dir: str, reservation: str, reqs, budget_tokens: int, max_model_len: int, max_steps: int | None):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine
    from pagedserve.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=budget_tokens // 16, block_size=16,
                                 max_model_len=max_model_len, max_num_seqs=len(reqs), kv_reservation=reservation,
                                 enable_prefix_caching=False))
    samples = []
    with tqdm(total=len(reqs), desc=f"{reservation} reservation", unit="req") as bar:
        for i, r in enumerate(reqs):
            engine.add_request(str(i), r.prompt_token_ids,
                               SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
        steps = 0
        while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
            for out in engine.step():
                if out.finished:
                    bar.update(1)
            steps += 1
            samples.append(_sample(engine, steps))
    running = [s[1] for s in samples]
    # Utilization is weighted by allocated slots, so idle tail steps don't dominate the mean.
    util = [s[2] for s in samples if s[1]]
    return {"reservation": reservation, "steps": len(samples), "peak_running": max(running),
            "mean_running": sum(running) / len(running), "mean_kv_utilization": sum(util) / len(util),
            "preemptions": engine.core.scheduler.num_preemptions, "samples": samples}


def run(args: argparse.Namespace) -> int:
    from pagedserve.bench.common import resolve_model as _resolve

    model_dir = _resolve(args.model)
    reqs = w3_seats(args.num_requests)
    budget_tokens = args.naive_seats * args.max_model_len
    results = {r: measure(model_dir, r, reqs, budget_tokens, args.max_model_len, args.max_steps)
               for r in ("paged", "max")}
    paged, naive = results["paged"], results["max"]
    ratio = paged["mean_running"] / naive["mean_running"]
    print(f"\nW3 on {args.model}: {len(reqs)} requests, KV budget {budget_tokens} tokens "
          f"({args.naive_seats} x {args.max_model_len}), block 16 ({machine_summary()})")
    print(f"  {'':22} {'peak running':>12} {'mean running':>12} {'KV utilization':>15} {'steps':>7} {'preemptions':>11}")
    for name, r in (("paged", paged), ("worst-case reservation", naive)):
        print(f"  {name:22} {r['peak_running']:12d} {r['mean_running']:12.1f} {r['mean_kv_utilization']:15.3f} "
              f"{r['steps']:7d} {r['preemptions']:11d}")
    print(f"  paged / worst-case mean running: {ratio:.2f}x")
    if args.plot:
        _plot(args.plot, paged, naive)
        print(f"  plot: {args.plot}")
    write_result(args.json_out, {"workload": "W3", "model": args.model, "ratio_mean_running": ratio,
                                 "paged": {k: v for k, v in paged.items() if k != "samples"},
                                 "max": {k: v for k, v in naive.items() if k != "samples"}})
    return 0


def _plot(path: str, paged: dict, naive: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r, label in ((paged, "paged blocks"), (naive, "worst-case reservation")):
        steps = [s[0] for s in r["samples"]]
        ax1.plot(steps, [s[1] for s in r["samples"]], label=label)
        ax2.plot(steps, [s[2] for s in r["samples"]], label=label)
    ax1.set_ylabel("running requests")
    ax1.legend()
    ax2.set_ylabel("KV utilization\n(tokens / allocated slots)")
    ax2.set_xlabel("engine step")
    ax2.set_ylim(0, 1.05)
    fig.suptitle("W3: the same KV memory, paged vs worst-case reservation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
