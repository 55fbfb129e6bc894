"""The standard workloads of docs/WORKLOADS.md as data: fixed seeds, lengths in tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int, first_normal_id: int = 3) -> list[int]:
    """Random token ids that are not special tokens (ids 0-2 are unk/bos/eos in the standard tokenizer)."""
    return rng.integers(first_normal_id, vocab_size, size=length).tolist()


def w1_offline(num_requests: int = 64, vocab_size: int = 32000, seed: int = 0) -> list[BenchRequest]:
    """W1: prompts uniform in [64, 512], outputs uniform in [32, 256], seed 0."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(64, 512, endpoint=True, size=num_requests)
    output_lens = rng.integers(32, 256, endpoint=True, size=num_requests)
    return [BenchRequest(random_prompt(rng, int(p), vocab_size), int(o)) for p, o in zip(prompt_lens, output_lens)]


def w2_single_stream(vocab_size: int = 32000, seed: int = 0) -> BenchRequest:
    """W2: one request, a 16-token prompt and 256 output tokens."""
    return BenchRequest(random_prompt(np.random.default_rng(seed), 16, vocab_size), 256)


def w3_seats(num_requests: int = 64, vocab_size: int = 32000, seed: int = 0) -> list[BenchRequest]:
    """W3: prompts uniform in [100, 700], outputs uniform in [300, 1300] (final lengths average ~1,200)."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(100, 700, endpoint=True, size=num_requests)
    output_lens = rng.integers(300, 1300, endpoint=True, size=num_requests)
    return [BenchRequest(random_prompt(rng, int(p), vocab_size), int(o)) for p, o in zip(prompt_lens, output_lens)]


def w5_shared_prefix(vocab_size: int = 32000, seed: int = 0) -> list[BenchRequest]:
    """W5: a 1,024-token prefix shared by two requests, each with a 32-token suffix and 16 outputs."""
    rng = np.random.default_rng(seed)
    prefix = random_prompt(rng, 1024, vocab_size)
    return [BenchRequest(prefix + random_prompt(rng, 32, vocab_size), 16) for _ in range(2)]
