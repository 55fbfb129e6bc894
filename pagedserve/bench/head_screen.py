"""``pagedserve bench head-screen``: W2 (one greedy stream, 16-token prompt, 256 tokens) with the LM
head's screen (:mod:`pagedserve.models.head_screen`, the default) against the full head
(``--no-head-screen``): two engines of the same model in one process, alternated round by round so
the machine's drift costs both alike; the two must give the same tokens, else the run stops. With
``--rows``, also one head call of that many hidden-state rows each way, cache cold (a buffer larger
than the L3 touched before each call, as a decode step finds the head after its layers). A GGUF Q8_0
head's screen takes steps of 4 rows or more only, so W2's one stream runs its full head both ways:
``--streams N`` runs N requests of W2's shape together (prompts of seeds 0..N-1), ``--rows`` times
single head calls."""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.bench.common import greedy_streams, machine_summary, median, resolve_model, write_result
from pagedserve.bench.workloads import w2_single_stream

MAX_STREAMS = 32  # their KV fits the engines' 256 MiB pools on the default model


def add_parser(bench) -> None:
    p = bench.add_parser("head-screen", help="W2 with the LM head's screen against the full head",
                         description="One greedy stream (W2: 16-token prompt, 256 tokens) through two engines of the "
                                     "same model, the LM head's screen on and off (--no-head-screen), alternating; "
                                     "prints decode tokens/s of each and the ratio, and stops if their tokens differ. "
                                     "A GGUF Q8_0 head's screen takes steps of 4 rows or more: time it with --streams "
                                     "or --rows.")
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--dtype", default="auto", help="compute dtype (default auto)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds after a warm-up (default 5)")
    p.add_argument("--output-len", type=int, default=256, help="tokens per stream (W2: 256)")
    p.add_argument("--streams", type=int, default=1, help=f"greedy requests of W2's shape run together, 1-{MAX_STREAMS} "
                                                            "(default 1: W2 itself)")
    p.add_argument("--rows", default="", help="comma-separated row counts (e.g. 1,2,4,8): also time one head call "
                                                "of each, screen against full head, cache cold (default: none)")
    p.add_argument("--calls", type=int, default=25, help="timed head calls per row count and way (median; default 25)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def head_calls_ms(model, rows: list[int], calls: int) -> list[dict]:
    """Per row count, the median ms of one call through the screen and through the full head, each
    after touching a 96 MiB buffer (past the L3: the weights come from memory, as in a step)."""
    import torch

    screen, native = model.head_screen, model.native_decode
    stack = None if native is None else native.stack
    flush = torch.empty(96 << 20, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)

    def cold_ms(fn) -> float:
        times = []
        for _ in range(calls + 1):  # the first untimed
            flush.add_(1)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times[1:])

    out = []
    with torch.inference_mode():
        for n in rows:
            h = torch.randn(n, model.norm.weight.shape[-1], generator=gen).to(model.norm.weight.dtype)
            out.append({"rows": n, "screen_ms": cold_ms(lambda: screen.logits(h, stack)),
                        "full_ms": cold_ms(lambda: model.compute_logits(h))})
    return out


def run(args: argparse.Namespace) -> int:
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"--rows must be comma-separated integers, got {args.rows!r}") from None
    if args.rounds < 1 or args.output_len < 2 or args.calls < 1 or any(r < 1 for r in rows):
        raise SystemExit("--rounds, --calls and every --rows entry must be >= 1, and --output-len >= 2")
    if not 1 <= args.streams <= MAX_STREAMS:
        raise SystemExit(f"--streams must be 1-{MAX_STREAMS}, got {args.streams}")
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    model = resolve_model(args.model)
    engines = {on: Engine(EngineConfig(model=model, dtype=args.dtype, kv_cache_memory="256MiB",
                                       enable_prefix_caching=False, head_screen=on)) for on in (True, False)}
    dtype = str(engines[True].core.dtype).removeprefix("torch.")
    try:
        if engines[True].core.runner.model.head_screen is None:
            raise SystemExit(f"{args.model}: its LM head has no screen here (a --quantization head, a GGUF head "
                             "other than Q8_0, no native kernels, or not on a CPU); the start-up log says why")
        vocab = engines[True].core.arch.vocab_size
        prompts = [w2_single_stream(vocab, seed=i).prompt_token_ids for i in range(args.streams)]
        rates: dict[bool, list[float]] = {True: [], False: []}
        for rnd in range(args.rounds + 1):  # round 0 warms both up, untimed
            tokens = {}
            for on in (False, True):
                rate, tokens[on] = greedy_streams(engines[on], prompts, args.output_len)
                if rnd:
                    rates[on].append(rate)
            if tokens[True] != tokens[False]:
                raise SystemExit("the screened head's tokens differ from the full head's: a bug, report it")
        calls = head_calls_ms(engines[True].core.runner.model, rows, args.calls) if rows else []
    finally:
        for engine in engines.values():
            engine.close()
    full, screened = median(rates[False]), median(rates[True])
    shape = "W2" if args.streams == 1 else f"{args.streams} streams of W2's shape"
    print(f"\n{shape} on {args.model} ({dtype}, {machine_summary()}), decode tokens/s, "
          f"{args.rounds} alternated rounds:")
    print(f"  full head   {full:8.1f}  ({', '.join(f'{r:.1f}' for r in rates[False])})")
    print(f"  head screen {screened:8.1f}  ({', '.join(f'{r:.1f}' for r in rates[True])})")
    print(f"  ratio {screened / full:.3f}x (the same tokens)")
    if calls:
        print(f"one head call, cache cold, median of {args.calls}:")
        for c in calls:
            print(f"  {c['rows']:3d} rows: screen {c['screen_ms']:.3f} ms, full head {c['full_ms']:.3f} ms, "
                  f"{c['full_ms'] / c['screen_ms']:.2f}x")
    write_result(args.json_out, {"benchmark": "head-screen", "model": args.model, "streams": args.streams,
                                 "dtype": dtype, "full_tok_s": rates[False],
                                 "screen_tok_s": rates[True], "ratio": screened / full, "calls": calls})
    return 0
