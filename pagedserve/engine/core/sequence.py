"""One request's state (``Request``) and each of its ``n`` completions (``Sequence``)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.engine.outputs import RequestMetrics, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the front end imports this module (through the block map) and needs no torch
    import torch

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """What a client asked for: a prompt, sampling params, a priority and a cache salt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    cache_salt: str | None = None
    metrics: RequestMetrics = field(init=False)
    seqs: list["Sequence"] = field(default_factory=list)
    num_cached_tokens: int = 0
    forked: bool = False  # the n > 1 children exist
    # With params.prompt_logprobs: entries for prompt tokens 0..len-1 computed so far (a recompute
    # after preemption adds none twice), and whether they went out in a CoreOutput yet.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # structured output: the compiled grammar (xgrammar.CompiledGrammar) once ready; each
    # completion has its own matcher from it
    compiled_grammar: Any = None

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time, queued_time=self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt={len(self.prompt_token_ids)} tokens, priority={self.priority})"


@dataclass(eq=False)
class Sequence:
    """One completion being generated: its tokens, how many have KV, and its sampling state.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the step that catches up with
    ``len(token_ids)`` also samples the next token. A preempted sequence drops to zero.
    """

    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    # Sum of the sampled tokens' logprobs (the same values ``logprobs`` holds), kept as the tokens
    # come so no one re-adds a long list; None when logprobs were not asked for, as in vLLM.
    cumulative_logprob: float | None = None
    num_preemptions: int = 0
    # structured output: an xgrammar.GrammarMatcher that has accepted exactly this completion's
    # output tokens (a preempted sequence keeps its tokens, so the matcher stays right as it is)
    grammar: Any = None
    # How much of the output has gone out in a CoreOutput already (tokens, logprobs, the finish).
    sent_token_len: int = 0
    sent_logprob_len: int = 0
    finish_sent: bool = False
    # Speculative decoding: the drafts this step verifies after the last token (empty otherwise;
    # they are never in token_ids until accepted), and the token ids as a numpy buffer for the
    # n-gram proposer (engine/core/ngram.py), created on first use.
    draft_token_ids: list[int] = field(default_factory=list)
    token_buffer: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority, then arrival, then completion index (stable FCFS)."""
        return (self.request.priority, self.request.arrival_time, self.seq_id)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(request={self.request.request_id!r}, index={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")

    def __lt__(self, other: "Sequence") -> bool:  # heap order for the waiting queue
        return self.sort_key < other.sort_key
