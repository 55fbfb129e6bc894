"""``pagedserve bench head-screen``: W2 (one greedy stream, 16-token prompt, 256 tokens) with the LM
head's screen (:mod:`pagedserve.models.head_screen`, the default) against the full head
(``--no-head-screen``): two engines of the same model in one process, alternated round by round so
the machine's drift costs both alike; the two must give the same tokens, else the run stops."""

from __future__ import annotations

import argparse

from pagedserve.bench.common import greedy_stream, machine_summary, median, resolve_model, write_result
from pagedserve.bench.workloads import w2_single_stream


def add_parser(bench) -> None:
    p = bench.add_parser("head-screen", help="W2 with the LM head's screen against the full head",
                         description="One greedy stream (W2: 16-token prompt, 256 tokens) through two engines of the "
                                     "same model, the LM head's screen on and off (--no-head-screen), alternating; "
                                     "prints decode tokens/s of each and the ratio, and stops if their tokens differ.")
    p.add_argument("--model", default="small", help="standard model name or model directory (default small)")
    p.add_argument("--dtype", default="auto", help="compute dtype (default auto)")
    p.add_argument("--rounds", type=int, default=5, help="alternated rounds after a warm-up (default 5)")
    p.add_argument("--output-len", type=int, default=256, help="tokens per stream (W2: 256)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.output_len < 2:
        raise SystemExit("--rounds must be >= 1 and --output-len >= 2")
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    model = resolve_model(args.model)
    engines = {on: Engine(EngineConfig(model=model, dtype=args.dtype, kv_cache_memory="256MiB",
                                       enable_prefix_caching=False, head_screen=on)) for on in (True, False)}
    dtype = str(engines[True].core.dtype).removeprefix("torch.")
    try:
        if engines[True].core.runner.model.head_screen is None:
            raise SystemExit(f"{args.model}: its LM head has no screen here (a GGUF or --quantization head, no "
                             "native kernels, or not on a CPU); the start-up log says why")
        prompt = w2_single_stream(engines[True].core.arch.vocab_size).prompt_token_ids
        rates: dict[bool, list[float]] = {True: [], False: []}
        for rnd in range(args.rounds + 1):  # round 0 warms both up, untimed
            tokens = {}
            for on in (False, True):
                rate, tokens[on] = greedy_stream(engines[on], prompt, args.output_len)
                if rnd:
                    rates[on].append(rate)
            if tokens[True] != tokens[False]:
                raise SystemExit("the screened head's tokens differ from the full head's: a bug, report it")
    finally:
        for engine in engines.values():
            engine.close()
    full, screened = median(rates[False]), median(rates[True])
    print(f"\nW2 on {args.model} ({dtype}, {machine_summary()}), decode tokens/s, "
          f"{args.rounds} alternated rounds:")
    print(f"  full head   {full:8.1f}  ({', '.join(f'{r:.1f}' for r in rates[False])})")
    print(f"  head screen {screened:8.1f}  ({', '.join(f'{r:.1f}' for r in rates[True])})")
    print(f"  ratio {screened / full:.3f}x (the same tokens)")
    write_result(args.json_out, {"benchmark": "head-screen", "model": args.model,
                                 "dtype": dtype, "full_tok_s": rates[False],
                                 "screen_tok_s": rates[True], "ratio": screened / full})
    return 0
