"""``pagedserve bench sampler``: the greedy pick of one step, the sampler's :func:`row_argmax` against
torch's own ``argmax``, on the same logits, interleaved, at the batch sizes a decode step has."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass

import torch

from pagedserve.bench.common import machine_summary, median_call_us, write_result
from pagedserve.engine.core.sampler import row_argmax


@dataclass
class PickTimes:
    rows: int
    torch_us: float  # median over the rounds
    ours_us: float

    @property
    def speedup(self) -> float:
        return self.torch_us / self.ours_us


def measure(vocab: int, rows: list[int], rounds: int, calls: int, seed: int = 0) -> list[PickTimes]:
    """Per batch size: the median pick time of each way, the two alternating round by round (so a
    noisy neighbour costs both alike); raises if they ever pick differently."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in rows:
        logits = torch.randn(n, vocab, generator=gen)
        if not torch.equal(row_argmax(logits), logits.argmax(dim=-1)):
            raise AssertionError(f"row_argmax disagrees with torch.argmax at {n} x {vocab}")
        theirs, ours = [], []
        for _ in range(rounds):
            theirs.append(median_call_us(lambda: logits.argmax(dim=-1), calls))
            ours.append(median_call_us(lambda: row_argmax(logits), calls))
        out.append(PickTimes(n, statistics.median(theirs), statistics.median(ours)))
    return out


def add_parser(bench) -> None:
    p = bench.add_parser("sampler", help="greedy pick per step: row_argmax vs torch.argmax",
                         description="Times the greedy pick of one decode step (float32 logits, one row per "
                                     "sequence) with the sampler's chunked row_argmax and with torch.argmax, "
                                     "alternating, and prints the ratio.")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000: the standard models')")
    p.add_argument("--rows", default="1,8,64", help="comma-separated batch sizes (default 1,8,64)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per batch size (median reported)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per round (their median is the round's)")
    p.add_argument("--json", dest="json_out", default=None, help="write the result as JSON to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = [int(r) for r in args.rows.split(",")]
    if args.vocab < 1 or not rows or min(rows) < 1 or args.rounds < 1 or args.calls < 1:
        raise SystemExit("--vocab, every --rows entry, --rounds and --calls must be >= 1")
    results = measure(args.vocab, rows, args.rounds, args.calls)
    print(f"greedy pick over {args.vocab} tokens ({machine_summary()}), median of {args.rounds} rounds:")
    for r in results:
        print(f"  {r.rows:4d} rows: torch.argmax {r.torch_us:8.1f} us   row_argmax {r.ours_us:8.1f} us   "
              f"{r.speedup:5.2f}x")
    write_result(args.json_out, {"vocab": args.vocab, "results": [asdict(r) | {"speedup": r.speedup} for r in results]})
    return 0
