"""What the peer drivers share: their arguments, the prompt, the decode rate and the JSON line they
print. Standard library only: it runs in the peers' venvs, where pagedserve is not installed."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on in the afternoon sun. "


def arguments(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--output", type=int, default=256, help="output tokens (at least 2)")
    p.add_argument("--requests", default=None,
                   help="W1 instead of one stream: a JSON list of {prompt: token ids, output: tokens}")
    return p


def read_requests(path: str) -> tuple[list[list[int]], list[int]]:
    """The prompts and output lengths of a requests file (``pagedserve bench compare``'s W1)."""
    with open(path) as f:
        requests = json.load(f)
    return [r["prompt"] for r in requests], [r["output"] for r in requests]


def batch_rate(generate_all: Callable[[list[list[int]], list[int]], object], prompts: list[list[int]],
               outputs: list[int]) -> float:
    """Output tokens/s of every request submitted at once, ``generate_all(prompts, max_tokens)``
    running them all to their ends, after a warm-up of the first eight for a few tokens."""
    generate_all(prompts[:8], [min(n, 4) for n in outputs[:8]])
    start = time.perf_counter()
    generate_all(prompts, outputs)
    return sum(outputs) / (time.perf_counter() - start)


def prompt_ids(encode: Callable[[str], list[int]], length: int) -> list[int]:
    """``length`` token ids of plain text (what they say does not change the speed)."""
    ids: list[int] = []
    while len(ids) < length:
        ids += encode(TEXT)
    return ids[:length]


def decode_rate(generate: Callable[[list[int], int], object], ids: list[int], output: int) -> float:
    """Tokens/s after the first of one greedy request, ``generate(ids, max_tokens)`` running it to
    its end: (output − 1) ÷ (time for ``output`` tokens − time for one), after a short warm-up.
    Two whole runs, because neither peer's offline API says when the first token came."""
    generate(ids, min(output, 4))
    times = {}
    for n in (1, output):
        start = time.perf_counter()
        generate(ids, n)
        times[n] = time.perf_counter() - start
    if output < 2 or times[output] <= times[1]:
        raise RuntimeError(f"cannot time decoding: {output} tokens took {times[output]:.3f} s, one {times[1]:.3f} s")
    return (output - 1) / (times[output] - times[1])


def report(rate: float) -> None:
    print(json.dumps({"tok_s": rate}), flush=True)
