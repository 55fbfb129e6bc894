"""The text side of generation: token ids from the core → text deltas, stop strings, logprobs.

It runs wherever the tokenizer is: inside the offline :class:`~pagedserve.engine.frontend.engine.Engine`,
or in the server's front end when the core runs in its own process. It never touches the KV
cache; when a stop string ends a completion it tells its caller which completion the core
should drop (``finish_in_core``), and tokens the core produced past that point are ignored.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pagedserve.engine.wire import CoreOutput
from pagedserve.engine.frontend.detokenizer import Detokenizer, TextState, find_stop_string
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class _Completion:
    index: int
    text: TextState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    sent_text_len: int = 0
    sent_token_len: int = 0
    sent_logprob_len: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    holdback: int  # characters kept back while running: a stop string may still be completing
    completions: dict[int, _Completion] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # from the core, once the prompt is computed


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs became."""

    outputs: list[RequestOutput] = field(default_factory=list)
    # (request id, completion index or None for the whole request) the core should drop now
    finish_in_core: list[tuple[str, int | None]] = field(default_factory=list)


class OutputProcessor:
    """Per-request text state for the requests in flight; not thread-safe (one owner)."""

    def __init__(self, tokenizer):
        self.detokenizer = Detokenizer(tokenizer)
        self.requests: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            prompt: str | None = None) -> None:
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.requests[request_id] = _RequestState(request_id, prompt, list(prompt_token_ids), params, holdback)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, core_outputs: list[CoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        now = time.monotonic()
        for core_out in core_outputs:
            state = self.requests.get(core_out.request_id)
            if state is None:
                continue  # aborted or already finished here (a stop string): late tokens are dropped
            if core_out.error is not None:
                del self.requests[core_out.request_id]
                result.outputs.append(RequestOutput(
                    core_out.request_id, state.prompt_token_ids, [], True, core_out.num_cached_tokens,
                    core_out.metrics, state.prompt, error=core_out.error))
                continue
            if core_out.prompt_logprobs is not None:
                state.prompt_logprobs = core_out.prompt_logprobs
            for delta in core_out.seqs:
                completion = state.completions.get(delta.index)
                if completion is None:
                    completion = state.completions[delta.index] = self._new_completion(state, delta.index)
                if completion.finish_reason is not None:
                    continue
                if delta.cumulative_logprob is not None:
                    completion.cumulative_logprob = delta.cumulative_logprob
                if self._apply(state, completion, delta.token_ids, delta.logprobs):
                    result.finish_in_core.append((state.request_id, delta.index))
                elif delta.finish_reason is not None:
                    completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
            finished = all(c.finish_reason is not None for c in state.completions.values()) and (
                core_out.finished or len(state.completions) == state.params.n)
            metrics = core_out.metrics
            if finished:
                del self.requests[state.request_id]
                if not core_out.finished:  # ended here by stop strings: the core still holds it
                    result.finish_in_core = [f for f in result.finish_in_core if f[0] != state.request_id]
                    result.finish_in_core.append((state.request_id, None))
                    metrics = dataclasses.replace(metrics, finished_time=now)
            result.outputs.append(self._request_output(state, finished, core_out.num_cached_tokens, metrics))
        return result

    def _new_completion(self, state: _RequestState, index: int) -> _Completion:
        text = self.detokenizer.start(state.prompt_token_ids, state.params.skip_special_tokens)
        return _Completion(index, text, logprobs=[] if state.params.logprobs is not None else None)

    def _apply(self, state: _RequestState, completion: _Completion, token_ids: list[int],
               logprobs: list[TokenLogprob] | None) -> bool:
        """Append new tokens one at a time (text, stop strings); True if a stop string ended it."""
        stops = state.params.stop
        for i, token in enumerate(token_ids):
            completion.token_ids.append(token)
            completion.text.token_ids.append(token)
            if completion.logprobs is not None and logprobs and i < len(logprobs):
                completion.logprobs.append(logprobs[i])
            new_text = self.detokenizer.update(completion.text)
            if stops and (hit := find_stop_string(completion.text.output_text, len(new_text), stops)):
                stop, idx = hit
                keep = idx + (len(stop) if state.params.include_stop_str_in_output else 0)
                completion.text.output_text = completion.text.output_text[:keep]
                completion.finish_reason, completion.stop_reason = "stop", stop
                if completion.cumulative_logprob is not None and logprobs:
                    # The core summed this delta's tokens past the stop too; they are dropped here.
                    completion.cumulative_logprob -= sum(lp.logprob for lp in logprobs[i + 1:])
                return True
        return False

    def _request_output(self, state: _RequestState, finished: bool, num_cached_tokens: int, metrics) -> RequestOutput:
        outputs = []
        for completion in sorted(state.completions.values(), key=lambda c: c.index):
            text = completion.text.output_text
            done = completion.finish_reason is not None
            visible = len(text) if done else max(completion.sent_text_len, len(text) - state.holdback)
            lps = completion.logprobs
            outputs.append(CompletionOutput(
                index=completion.index, text=text[:visible], token_ids=list(completion.token_ids),
                delta_text=text[completion.sent_text_len:visible],
                delta_token_ids=completion.token_ids[completion.sent_token_len:], logprobs=lps,
                delta_logprobs=None if lps is None else lps[completion.sent_logprob_len:],
                cumulative_logprob=completion.cumulative_logprob, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason))
            completion.sent_text_len, completion.sent_token_len = visible, len(completion.token_ids)
            completion.sent_logprob_len = len(lps or ())
        return RequestOutput(state.request_id, state.prompt_token_ids, outputs, finished, num_cached_tokens,
                             metrics, state.prompt, prompt_logprobs=state.prompt_logprobs)
