"""``pagedserve bench make-model NAME DIR``: write a standard random-weight checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedserve.models.standard import STANDARD_MODELS, build_standard_model


def add_parser(bench) -> None:
    p = bench.add_parser("make-model", help="build a standard random-weight checkpoint of docs/WORKLOADS.md",
                         description="Build one of the standard models (Llama architecture, random weights with a "
                                     "fixed seed, bf16 safetensors) with a BPE tokenizer trained locally on the "
                                     "Python standard library's sources. Nothing is downloaded.")
    p.add_argument("name", choices=sorted(STANDARD_MODELS), help="which standard model")
    p.add_argument("dir", type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = build_standard_model(args.name, args.dir, seed=args.seed)
    print(f"wrote {args.name} to {out}")
    return 0
