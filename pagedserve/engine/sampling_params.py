"""Per-request sampling parameters, validated once when the request is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.errors import InvalidRequest


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
    top_k: int = 0  # 0 or -1: disabled
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequest:
            return InvalidRequest(msg, param=param)

        if not 1 <= self.n <= 128:
            raise bad("n", f"n must be between 1 and 128, got {self.n}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"temperature must be in [0, 100], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"logprobs / top_logprobs must be between 0 and 20, got {self.logprobs}.")
        if self.seed is not None and not 0 <= self.seed < 2**63 - 256:
            raise bad("seed", f"seed must be in [0, 2**63 - 256), got {self.seed}.")  # room for seed + index
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop strings, got {len(self.stop)}.")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative token ids.")

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
