"""``pagedserve generate``: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagedserve.engine.args import add_engine_args, engine_config_from_args
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.errors import PagedServeError, startup_error_line

logger = logging.getLogger("pagedserve.generate")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate completions offline for one or more prompts",
                              description="Run prompts through the engine (no server) and print the completions.")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt (repeat for several); with none, one prompt per line is read from stdin")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per completion")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from pagedserve.engine.frontend.llm import LLM
    from pagedserve.models.default import ensure_default_model

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("no prompts: pass --prompt or pipe prompts on stdin", file=sys.stderr)
        return 2
    # A wrong --model, an unsupported architecture, a KV budget that holds no block, a
    # --max-model-len past the model's: one line, as `serve` says it (the same wording), not a traceback.
    try:
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        config = engine_config_from_args(args, model=args.model or str(ensure_default_model()))
        llm = LLM(**vars(config))
    except Exception as exc:  # noqa: BLE001 - every startup failure gets its one line; --log-level DEBUG: the trace
        logger.debug("engine start-up failed", exc_info=True)
        logger.error("cannot start: %s", startup_error_line(exc))
        return 2
    try:
        outputs = llm.generate(prompts, params)
    except PagedServeError as exc:  # a prompt too long for the model or the pool
        logger.error("cannot generate: %s", exc.message)
        return 1
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "completions": [
                {"text": c.text, "finish_reason": c.finish_reason, "tokens": len(c.token_ids)} for c in out.outputs]}))
        else:
            for c in out.outputs:
                print(f"{prompt!r} -> {c.text!r} ({c.finish_reason}, {len(c.token_ids)} tokens)")
    return 0
