"""What crosses between the engine core and a front end: msgspec messages and the model's facts.

They live apart from :mod:`pagedserve.engine.core.engine_core` and :mod:`pagedserve.engine.core.proc` (which
name them too) so that a front end, which only encodes and decodes them, imports neither the
core nor torch. See :mod:`pagedserve.engine.core.proc` for the protocol.
"""

from __future__ import annotations

import dataclasses

import msgspec

from pagedserve import errors
from pagedserve.engine.block_map import BlockMap
from pagedserve.engine.outputs import EngineStats, RequestMetrics, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one completion gained in a step: new token ids (and their logprobs), and its end."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" (EOS or a stop token), "length"; None while running
    stop_reason: int | None = None  # the stop token id that ended it
    cumulative_logprob: float | None = None  # the running sum after this delta's tokens


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress after a step (token ids only). ``error`` set: the request failed."""

    request_id: str
    seqs: list[SeqDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, with the first output after the prompt


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What a front end needs to know of the engine it talks to (sent by the core at start-up)."""

    model_name: str
    model_dir: str
    tokenizer: str  # where the front end loads its own tokenizer from
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    kv_dtype: str
    dtype: str
    device: str
    attention_backend: str
    weight_bytes: int
    enable_prefix_caching: bool = True  # /metrics' vllm:cache_config_info reports it
    num_threads: int = 1  # CPU threads of the model step in the core's process (the startup log says it)
    threads_pinned: bool = False  # OpenMP binds them to places (serve --bind-step-threads, or OMP_PROC_BIND)


# ---- front end → core, and the core's answers (pagedserve.engine.core.proc) ----

class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    index: int | None = None  # one completion of an n > 1 request (a stop string ended it)


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Stop the core loop, once what its pass applied has gone out with the final stats."""


class WatchBlocks(msgspec.Struct, tag=True, array_like=True):
    on: bool  # a dashboard is (no longer) watching: make block-map snapshots (or stop)


Command = AddRequest | Abort | Shutdown | WatchBlocks


class Admission(msgspec.Struct, array_like=True, omit_defaults=True):
    """The answer to one AddRequest: admitted (``error_class`` None) or refused with a typed error."""

    request_id: str
    error_class: str | None = None
    message: str = ""
    param: str | None = None
    retry_after_s: float | None = None

    def to_exception(self) -> errors.PagedServeError:
        cls = getattr(errors, self.error_class or "", None)
        if not (isinstance(cls, type) and issubclass(cls, errors.PagedServeError)):
            cls = errors.InvalidRequest
        if cls is errors.QueueFull:
            return errors.QueueFull(self.message, retry_after_s=self.retry_after_s or 1.0)
        return cls(self.message, param=self.param)


class CoreBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything the core says after one pass of its loop."""

    admissions: list[Admission] = []
    aborted: list[str] = []  # requests the core dropped on request (for the abort counter)
    outputs: list[CoreOutput] = []
    stats: EngineStats | None = None
    block_map: BlockMap | None = None  # only while watched (pagedserve.engine.block_map)
