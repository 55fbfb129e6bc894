"""Tokenization and chat templates off the event loop: one worker thread with its own tokenizer.

A 4 MB prompt takes seconds to tokenize; on the event loop that would stall ``/health`` and
every stream. Here it runs on a dedicated thread, through the tokenizer's batch entry point,
which releases the GIL while the Rust backend works. The worker owns its tokenizer instance (a
Hugging Face fast tokenizer used from two threads at once can fail with "Already borrowed"), and
its queue is bounded: past ``max_pending`` jobs a request is told to retry (503), not queued
without limit. The tokenizer is :func:`pagedserve.tokenizer.load_tokenizer`'s: no transformers
(nor torch) in the front unless the model's tokenizer needs them.

A prompt that cannot fit whatever it tokenizes to is refused before any work: every token
covers at most ``max_token_chars`` characters, so a text longer than ``max_model_len ×
max_token_chars`` (with a safety factor) tokenizes to more than ``max_model_len`` tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from pagedserve import errors
from pagedserve.tokenizer import TokenizerPreload, load_tokenizer

T = TypeVar("T")
# Margin on the "cannot fit" bound, for normalizers that shrink text a little (NFKC and the like).
_SAFETY_FACTOR = 4


class TokenizerWorker:
    """Runs tokenizer work on one thread; ``await worker.run(fn, ...)`` calls ``fn(tokenizer, ...)`` there."""

    def __init__(self, tokenizer_source: str, max_pending: int = 256, chat_template: str | None = None,
                 preload: TokenizerPreload | None = None):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-tok")
        # Loaded (or taken from ``preload``) on the worker thread itself: nothing else ever uses
        # this instance. A --chat-template replaces the tokenizer's own.
        self.tokenizer = self._executor.submit(load_tokenizer, tokenizer_source, chat_template, preload).result()
        vocab = self.tokenizer.get_vocab()
        self.max_token_chars = max((len(t) for t in vocab), default=16)
        self.max_pending = max_pending
        self._pending = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pending >= self.max_pending:
            raise errors.QueueFull(f"the tokenizer has {self._pending} prompts queued; retry shortly",
                                   retry_after_s=1.0)
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self.tokenizer, *args)
        finally:
            self._pending -= 1

    def check_fits(self, text: str, max_model_len: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit ``max_model_len`` tokens whatever its tokens."""
        limit = max_model_len * self.max_token_chars * _SAFETY_FACTOR
        if len(text) > limit:
            raise errors.RequestTooLong(
                f"The prompt is {len(text):,} characters: more than this model's maximum context length of "
                f"{max_model_len} tokens can hold (at most {limit:,} characters); shorten it.", param=param)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` through the batch entry point, which releases the GIL while it works."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
