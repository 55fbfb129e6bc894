"""``pagedserve bench train-model``: train (or show) the stdlib-trained quality model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging


def add_parser(bench) -> None:
    p = bench.add_parser(
        "train-model", help="train the small stdlib model that quality figures are measured on (cached)",
        description="Train a small Llama-architecture model (tied embeddings, GQA, a 4,096-token BPE tokenizer) on "
                    "the Python standard library's sources, one file in ten held out, and cache it. Prints its "
                    "directory and training report; a second run reuses the cache.")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the standard recipe's)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock cap on training; the learning-rate schedule ends with it (default: the recipe's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (on a busy machine 1 can be much faster than 2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.bench.trained import DEFAULT_SPEC, REPORT_FILE, ensure_trained_model

    logging.basicConfig(level=logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.steps is not None and args.steps < 1) or (args.max_seconds is not None and args.max_seconds <= 0):
        raise SystemExit("--steps must be >= 1 and --max-seconds > 0")
    spec = DEFAULT_SPEC
    steps = args.steps if args.steps is not None else spec.steps
    seconds = args.max_seconds if args.max_seconds is not None else spec.max_seconds
    if (steps, seconds) != (spec.steps, spec.max_seconds):
        # Another recipe is another model: it gets its own cache directory.
        spec = dataclasses.replace(spec, name=f"{spec.name}-{steps}steps-{seconds:.0f}s", steps=steps,
                                   max_seconds=seconds)
    out = ensure_trained_model(spec)
    print(out)
    print(json.dumps(json.loads((out / REPORT_FILE).read_text()), indent=2))
    return 0
