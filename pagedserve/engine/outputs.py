"""What the engine hands back each step: per-request outputs and engine-wide stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of one generated token and, if asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # the token's rank in the distribution (1 = most likely); set for prompt tokens


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions: cumulative text and tokens plus this step's delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    # Sum of ``logprobs[i].logprob`` over the tokens so far (the model's raw distribution, as
    # vLLM's default logprobs mode); None when logprobs were not requested, as in vLLM.
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic``) of one request's life. ``arrival_time``: it reached
    the server (the API layer); ``queued_time``: the engine queued it. TTFT and end-to-end time count
    from arrival, queue time from ``queued_time`` to the first step that scheduled it (vLLM's)."""

    arrival_time: float
    queued_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step. ``finished`` is True once every completion has ended."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt: str | None = None
    error: str | None = None  # set when the request failed in the engine (its outputs are then empty)
    # With SamplingParams.prompt_logprobs: one entry per prompt token (the first is None: nothing
    # predicts it), on every output once the prompt has been computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine's load and KV pool, for logs, /metrics and /load (an idle pool's
    counts are the defaults)."""

    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 0
    max_model_len: int = 0
    block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached_free: int = 0
    kv_tokens_in_use: int = 0
    kv_slots_allocated: int = 0
    naive_reserved_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    kv_bytes_per_token: int = 0
    generation_tokens: int = 0  # cumulative: every token sampled, whether or not an output carried it yet
    failed_requests: int = 0  # cumulative: requests ended by an error in their own processing
    # Speculative decoding, cumulative (vLLM's vllm:spec_decode_* counters): verification steps of a
    # sequence with at least one draft, draft tokens proposed, draft tokens the target accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    ended_requests: int = 0  # cumulative: requests that left the engine (finished, failed or aborted)

    @property
    def kv_utilization(self) -> float:
        """Tokens in use ÷ token slots in allocated blocks (0.0 when nothing is allocated)."""
        return self.kv_tokens_in_use / self.kv_slots_allocated if self.kv_slots_allocated else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens ÷ draft tokens proposed (0.0 before any draft)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
