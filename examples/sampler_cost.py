"""What drawing one token per row costs the engine's sampler, sampled (temperature 1, the OpenAI
API's default, what vLLM's `bench serve` gets) against greedy in the same run: ``sample()`` over
ROWS × VOCAB float32 logits, median of 50 calls each after a warm-up.

Usage: python examples/sampler_cost.py [ROWS] [VOCAB]   (default 64 32000: a decode step of 64 on `small`)
"""

import statistics
import sys
import time

import torch

from pagedserve.engine.core.sampler import SamplingRow, sample
from pagedserve.engine.sampling_params import SamplingParams


def median_ms(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator) -> float:
    sample(logits, rows, generator)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        sample(logits, rows, generator)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    rows_n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 32000
    logits = torch.randn(rows_n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    generator = torch.Generator().manual_seed(1)

    def rows(temperature: float) -> list[SamplingRow]:
        return [SamplingRow(SamplingParams(temperature=temperature, max_tokens=16), None, [1] * 300, [5] * 100, [])
                for _ in range(rows_n)]

    greedy, sampled = median_ms(logits, rows(0.0), generator), median_ms(logits, rows(1.0), generator)
    print(f"{rows_n} rows x {vocab}, {torch.get_num_threads()} threads: greedy {greedy:.2f} ms, "
          f"temperature 1 {sampled:.2f} ms ({sampled / greedy:.2f}x greedy)")


if __name__ == "__main__":
    main()
