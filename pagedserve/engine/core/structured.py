"""Structured output with xgrammar: grammars compiled off the step loop, one token mask per batch.

- :func:`check` parses a spec into an xgrammar ``Grammar`` (no tokenizer, milliseconds) and turns
  a spec that cannot be parsed into :class:`~pagedserve.errors.InvalidRequest` naming the problem.
  The server calls it before a request reaches the engine, so a bad schema is a 400.
- :class:`GrammarCompiler` lives in the core. ``compile(spec)`` returns a future: compilation
  (the per-token mask cache over the whole vocabulary, tens to hundreds of milliseconds) runs on
  one worker thread, where xgrammar releases the GIL, while the core keeps stepping; the request
  enters the scheduler only once its future is done. Futures are cached per ``(kind, spec)``, so
  50 requests with one schema compile it once (and share an in-flight compile).
- :func:`apply_masks` fills one ``[rows, vocab/32]`` int32 bitmask for the batch (xgrammar's batch
  matcher, in C++) and applies it to the logits in one vectorised call
  (``apply_token_bitmask_inplace``): no Python loop over the vocabulary.

The logits are ``arch.vocab_size`` wide, which may be more than the tokenizer's vocabulary (padded
embeddings): the tokenizer info is built with the model's width, so the padding ids are never
allowed, and the masks are applied up to the logits' own width.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import re
from typing import TYPE_CHECKING, Any

from pagedserve.engine.sampling_params import StructuredOutputsParams
from pagedserve.errors import InvalidRequest

if TYPE_CHECKING:  # the front end imports check(); xgrammar (which imports torch) loads on first use
    import torch
    import xgrammar

logger = logging.getLogger(__name__)

# JSON between tokens: any whitespace, but at most this many characters of it in one place, so a
# model (a random one especially) cannot pad a document with whitespace until max_tokens.
MAX_JSON_WHITESPACE = 16
# Compiled grammars kept (each holds a mask cache over the vocabulary: tens to hundreds of KiB).
CACHE_SIZE = 256
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the client needs what follows.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _message(exc: Exception) -> str:
    return _XGR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are xgrammar's)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar (0.2.9) lets a string with maxLength / minLength hold raw control characters (its
# plain strings exclude them), which JSON (RFC 8259) forbids: json.loads refuses such output.
_LOOSE_JSON_CHAR = r'[^\"\\\r\n]'
_STRICT_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _json_grammar(schema: str) -> xgrammar.Grammar:
    """The schema's grammar, with every string character class closed to U+0000-U+001F."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    text = str(grammar)
    if _LOOSE_JSON_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_JSON_CHAR, _STRICT_JSON_CHAR))


def _grammar(spec: StructuredOutputsParams) -> xgrammar.Grammar:
    import xgrammar as xgr

    kind, text = spec.key
    build = {"json": _json_grammar, "regex": xgr.Grammar.from_regex, "grammar": xgr.Grammar.from_ebnf,
             "choice": lambda _: xgr.Grammar.from_ebnf(choice_ebnf(spec.choice or [])),
             # OpenAI's JSON mode, any object (xgrammar's builtin JSON grammar takes arrays too)
             "json_object": lambda _: _json_grammar('{"type": "object"}')}
    return build[kind](text)


def check(spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """Raise :class:`InvalidRequest` if ``spec`` does not parse (a bad schema, regex or grammar)."""
    try:
        _grammar(spec)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its InvalidJSONError
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}.get(spec.kind, "spec")
        raise InvalidRequest(f"The {what} cannot be compiled: {_message(exc)}", param=param) from None


class GrammarCompiler:
    """Compiles specs for one tokenizer on a worker thread; results cached per ``(kind, spec)``.

    Nothing of xgrammar is loaded until the first structured request: the tokenizer info (a scan
    of the vocabulary, ~0.3 s) is built on the worker thread with that request's compile.
    """

    def __init__(self, tokenizer_source: str, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer_source = tokenizer_source
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on the worker thread
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = collections.OrderedDict()
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on the step thread when first used

    def compile(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled grammar (``xgrammar.CompiledGrammar``); raises InvalidRequest in
        the future's result if the spec cannot compile."""
        key = spec.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-grammar")
        future = self._executor.submit(self._compile, spec)
        self._cache[key] = future
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        import xgrammar as xgr

        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_source)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=max(self._vocab_size, len(tokenizer)),
                                                      stop_token_ids=self._stop_token_ids)
            # One thread: the core's step runs beside it on a machine that may have two cores.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        try:
            return self._compiler.compile_grammar(_grammar(spec))
        except Exception as exc:
            raise InvalidRequest(f"The {spec.kind} spec cannot be compiled: {_message(exc)}",
                                 param="structured_outputs") from None

    @staticmethod
    def matcher(compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher (one per completion: n > 1 completions diverge)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def apply_masks(self, logits: torch.Tensor, matchers: list[Any], rows: list[int]) -> None:
        """Mask ``logits[rows[i]]`` to what ``matchers[i]`` allows next, in place."""
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows)
