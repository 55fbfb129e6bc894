"""Prompt-lookup (n-gram) draft proposer for speculative decoding.

For a decoding sequence it finds the most recent earlier place where the sequence's last ``n``
tokens occur in its own prompt + output (``n`` from ``max_n`` down to ``min_n``, the longest match
wins) and proposes the up-to-``k`` tokens that followed that place. No model runs: on text that
quotes or repeats its context (code edits, summaries citing the source, RAG answers) the drafts
are often right, and the target model verifies them all in one forward pass.

It runs every step for every decoding sequence, so it is a few numpy operations over the token
array: one vectorised comparison per n-gram length, no Python loop over positions. Each
sequence keeps a numpy copy of its tokens that grows with it (:class:`TokenBuffer`), so a step
copies only the tokens appended since the last one.
"""

from __future__ import annotations

import numpy as np


class TokenBuffer:
    """A sequence's token ids as a growing numpy array (capacity doubles; appends are amortised O(1))."""

    __slots__ = ("array", "length")

    def __init__(self) -> None:
        self.array = np.empty(64, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The tokens as a view of length ``len(token_ids)``; copies only what was appended since."""
        n = len(token_ids)
        if n < self.length:  # tokens never shrink in a sequence; start over if someone replaced them
            self.length = 0
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        if n > self.length:
            self.array[self.length:n] = token_ids[self.length:n]
            self.length = n
        return self.array[:n]


def propose(tokens: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` (a 1-D int array), or none if nothing matches.

    A match for length ``n`` is an end position ``e < L - 1`` with ``tokens[e-n+1 .. e] ==
    tokens[L-n .. L-1]``; ``ok[e]`` is built one length at a time (``ok_n = ok_{n-1} and the
    token n-1 places back also matches``), so every length costs one vectorised comparison and
    the longest length that still has a match is the answer. Its latest end wins.
    """
    length = tokens.shape[0]
    if k <= 0 or length < min_n + 1:
        return []
    last_end = length - 1  # candidate ends e run over 0 .. L-2 (there must be a token after e)
    ok = tokens[:last_end] == tokens[last_end]
    best = -1
    for n in range(1, min(max_n, last_end) + 1):
        if n > 1:
            # tokens[e - (n-1)] == tokens[L-1 - (n-1)] for e >= n-1; ends before that cannot match
            ok[n - 1:] &= tokens[:last_end - (n - 1)] == tokens[last_end - (n - 1)]
            ok[n - 2] = False
        hits = np.flatnonzero(ok[n - 1:])
        if hits.size == 0:
            break  # no match of length n means none longer either
        if n >= min_n:
            best = int(hits[-1]) + n - 1
    if best < 0:
        return []
    return tokens[best + 1:best + 1 + k].tolist()
