"""Per-request sampling parameters, and the bounds :meth:`SamplingParams.validate` holds them to.

``validate()`` runs once per request, in the front end's request check
(:mod:`pagedserve.engine.frontend.request_check`), never on construction: a copy made in the core or
decoded from the wire is not checked again. Every field is bounded to what the engine can hold (the
server's schema checks the same bounds first, from the constants below):

- integers that reach the sampler's tensors or torch's generators (``top_k``, ``seed``, token
  ids) stay in the ranges those hold: a ``top_k`` of 2**70 does not fit an int64 tensor;
- counts and lengths (``max_tokens``, ``min_tokens``) stay int32, far above any context length;
- floats are finite (NaN fails every range check, but is named here as what it is);
- lists (stop strings, stop token ids) are short enough that per-step stop checks stay cheap;
- ``logit_bias`` holds at most :data:`MAX_LOGIT_BIAS` entries, each bias in [-100, 100] (OpenAI's
  range), so the sampler's scatter-add over the batch stays a few hundred elements a row.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.errors import InvalidRequest

MAX_N = 128
# max_tokens / min_tokens: int32, so they are safe in any tensor; no model has a longer context.
MAX_TOKENS_LIMIT = 2**31 - 1
# top_k at or above the vocabulary size cuts nothing (the sampler keeps the whole vocabulary);
# the bound only keeps the value inside the sampler's int64 tensors with room to spare.
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_STREAM_INTERVAL = 1024  # tokens per streamed output; far beyond any useful batching of a stream
MAX_STOP_CHARS = 512  # per stop string: streamed text holds back the longest one's length
MAX_STOP_TOKEN_IDS = 128
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; the engine compares ids with its own vocab
# Any int64. Completion i of a request is seeded with seed + i (i < MAX_N), which stays within
# the range torch's generators accept ([-2**63, 2**64 - 1]).
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
TEMPERATURE_MAX = 100.0
PENALTY_MAX = 2.0  # presence and frequency: [-2, 2] (OpenAI)
REPETITION_PENALTY_MAX = 10.0
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI documents no count; 300 covers every harness)
LOGIT_BIAS_MAX = 100.0  # |bias| (OpenAI's range: -100 bans a token, 100 forces it)
# Structured output: a JSON schema, regex or grammar is compiled against the whole vocabulary,
# so its size is bounded; so are the choices of a choice constraint.
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``): set exactly one.

    ``json`` is a JSON schema (a dict, or its JSON text); ``json_object`` any JSON object;
    ``regex`` a regular expression; ``choice`` one of a list of strings; ``grammar`` an EBNF
    grammar (xgrammar's dialect, GBNF-like, rule ``root``). The engine compiles it once per
    distinct spec and masks every sampled token to what the grammar allows; reaching the
    grammar's end finishes the completion with ``finish_reason == "stop"``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # one text form, so equal schemas share one compiled grammar
            self.json = json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next((k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None), "json_object")

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, spec text)``: what a compiled grammar is cached under."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    def check_grammar(self, param: str = "structured_outputs") -> None:
        """Raise :class:`InvalidRequest` if the spec does not compile (a bad schema, regex or
        grammar); tokenizer-free, but it loads xgrammar: call it off the event loop."""
        from pagedserve.engine.core.structured import check

        check(self, param)

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(msg, param="structured_outputs")

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object is not False and self.json_object is not True:
            raise bad(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}.")
        if len(given) + bool(self.json_object) != 1:
            raise bad("structured_outputs must set exactly one of json, regex, choice, grammar or json_object, "
                      f"got {len(given) + bool(self.json_object)}.")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise bad(f"structured_outputs.{name} must be a string, got {type(value).__name__}.")
            if not value:
                raise bad(f"structured_outputs.{name} must not be empty.")
            if len(value) > MAX_GRAMMAR_CHARS:
                raise bad(f"structured_outputs.{name} may be at most {MAX_GRAMMAR_CHARS} characters, "
                          f"got {len(value)}.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice):
                raise bad("structured_outputs.choice must be a list of strings.")
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise bad(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} strings, got {len(self.choice)}.")
            if any(not c or len(c) > MAX_CHOICE_CHARS for c in self.choice):
                raise bad(f"each structured_outputs.choice must be 1 to {MAX_CHOICE_CHARS} characters long.")


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Field names and meanings follow vLLM's ``SamplingParams`` and the OpenAI API, so a request
    body maps onto this without renaming. ``temperature == 0`` means greedy.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled; >= the vocabulary size: no cut either
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the chosen token
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # top logprobs per prompt token (vLLM's prompt_logprobs); 0 = only the prompt token's own
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Stream this request's output every N new tokens (the first at once); the engine's own
    # stream_interval is a floor: a request can ask for coarser streaming, never finer.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)):
            self.stop = [s for s in self.stop if s]
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise :class:`InvalidRequest` naming the first field outside what the engine can hold."""
        def bad(param: str, msg: str) -> InvalidRequest:
            return InvalidRequest(msg, param=param)

        def integer(name: str, lo: int, hi: int, what: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise bad(name, f"{name} must be an integer, got {value!r}.")
            if not lo <= value <= hi:
                raise bad(name, f"{name} must be {what}, got {value}.")

        def token_id(name: str, value: object, what: str) -> None:
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN_ID:
                raise bad(name, f"{what} must be token ids in [0, {MAX_TOKEN_ID}], got {value!r}.")

        def real(name: str, value: Any, ok: Callable[[float], bool], what: str) -> None:
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise bad(name, f"{name} must be a number, got {value!r}.")
            if not math.isfinite(value):
                raise bad(name, f"{name} must be a finite number, got {value}.")
            if not ok(value):
                raise bad(name, f"{name} must be {what}, got {value}.")

        integer("n", 1, MAX_N, f"between 1 and {MAX_N}")
        integer("stream_interval", 1, MAX_STREAM_INTERVAL,
                f"between 1 and {MAX_STREAM_INTERVAL} (tokens per streamed output)")
        integer("max_tokens", 1, MAX_TOKENS_LIMIT, f"between 1 and {MAX_TOKENS_LIMIT}", optional=True)
        integer("min_tokens", 0, MAX_TOKENS_LIMIT, f"between 0 and {MAX_TOKENS_LIMIT}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        real("temperature", self.temperature, lambda v: 0.0 <= v <= TEMPERATURE_MAX,
             f"in [0, {TEMPERATURE_MAX:g}]")
        real("top_p", self.top_p, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        integer("top_k", 0, MAX_TOP_K, f"-1 or 0 (disabled) or a positive count up to {MAX_TOP_K} (a count at or "
                "above the vocabulary size keeps every token)")
        real("min_p", self.min_p, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            real(name, getattr(self, name), lambda v: -PENALTY_MAX <= v <= PENALTY_MAX,
                 f"in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]")
        real("repetition_penalty", self.repetition_penalty, lambda v: 0.0 < v <= REPETITION_PENALTY_MAX,
             f"in (0, {REPETITION_PENALTY_MAX:g}]")
        integer("logprobs", 0, MAX_LOGPROBS, f"between 0 and {MAX_LOGPROBS} (logprobs / top_logprobs)", optional=True)
        integer("seed", SEED_MIN, SEED_MAX, "a 64-bit signed integer ([-2**63, 2**63 - 1])", optional=True)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "stop must be a string or a list of strings.")
        if len(self.stop) > MAX_STOP:
            raise bad("stop", f"at most {MAX_STOP} stop strings, got {len(self.stop)}.")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise bad("stop", f"stop strings may be at most {MAX_STOP_CHARS} characters long, got one of {longest}.")
        if not isinstance(self.stop_token_ids, list):
            raise bad("stop_token_ids", "stop_token_ids must be a list of token ids.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}.")
        for t in self.stop_token_ids:
            token_id("stop_token_ids", t, "stop_token_ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "logit_bias must map token ids to biases.")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}.")
            for t, v in self.logit_bias.items():
                token_id("logit_bias", t, "logit_bias keys")
                real("logit_bias", v, lambda x: -LOGIT_BIAS_MAX <= x <= LOGIT_BIAS_MAX,
                     f"in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}] (the bias of token {t})")
        integer("prompt_logprobs", 0, MAX_LOGPROBS, f"between 0 and {MAX_LOGPROBS}", optional=True)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "structured_outputs must be a StructuredOutputsParams.")
            self.structured_outputs.validate()

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
