"""EngineClient: all a server (or anything else that serves) knows of the engine.

```
 server process                                               engine core
 ──────────────                                               ───────────
 HTTP, validation, tokenizer + chat template (worker thread)
      │ token ids + SamplingParams
      ▼
 EngineClient.add_request() ─────────────────────────────────▶ scheduler, blocks, model, sampler
 RequestStream (async iterator) ◀── OutputProcessor (text) ◀── new token ids per step
 EngineClient.abort() / load() / stats() / facts
```

Both implementations (:mod:`~pagedserve.engine.frontend.async_engine`: in-process;
:mod:`~pagedserve.engine.frontend.mp_client`: the core in its own process) are a
:class:`~pagedserve.engine.frontend.core_client.CoreClient`, built by
:mod:`pagedserve.engine.frontend.factory`. Every method is called from the one event loop that
consumes the streams.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve import errors
from pagedserve.engine.block_map import BlockMap
from pagedserve.engine.wire import ModelFacts
from pagedserve.engine.outputs import EngineStats, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.frontend.core_client import CoreClient

logger = logging.getLogger(__name__)
# log_requests writes here: one key=value line per finished request, easy to grep or parse.
request_log = logging.getLogger("pagedserve.requests")

# Window over which /load's tokens/s and completion rate are measured.
RATE_WINDOW_S = 10.0


class StepObserver(Protocol):
    """Hooks the client calls on its event loop as outputs arrive (metrics use them); quick, never raising."""

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Called with each batch of outputs delivered to the streams."""

    def on_abort(self, request_id: str, now: float) -> None:
        """Called when a live request is aborted (client gone, shutdown)."""


class EngineDeadError(errors.PagedServeError):
    """The engine stopped (crashed, or shut down); the server cannot take new requests."""

    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"


class RequestFailed(errors.PagedServeError):
    """This request's own processing raised inside the engine; it alone was ended, the rest go on."""

    status_code = 500
    error_type = "server_error"
    code = "request_failed"


@dataclass
class LoadReport:
    """The engine's load as the gateway sees it: ``GET /load``'s body and schema, defined here once."""

    running: int
    waiting: int
    max_num_seqs: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    kv_utilization: float
    tokens_per_s: float
    est_queue_wait_s: float
    model: str = ""  # the name the server serves it under (the server fills it in)


_END = object()  # put on a stream's queue when its request was aborted


class RequestStream:
    """Async iterator over one request's :class:`RequestOutput` s, ending after the finished one.

    Use it as ``async with stream: async for out in stream: ...``: leaving the block early (a
    ``break``, an exception, cancellation) aborts the request, so its KV blocks are freed whichever
    way the consumer stops. An output carrying an error raises :class:`RequestFailed`.
    """

    def __init__(self, request_id: str, client: CoreClient, priority: int = 0):
        self.request_id = request_id
        self.priority = priority
        self._client = client
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.abort()
            raise
        if item is _END:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            self._client._forget(self.request_id)
            if item.error is not None:
                raise RequestFailed(f"the engine failed while processing this request ({item.error}); "
                                    "other requests were not affected, retry it")
        return item

    def abort(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)


class EngineClient(abc.ABC):
    """The engine as a server sees it: submit, stream, abort, load, stats and the model's facts.

    Everything a server reads or sets on a client is declared here; it needs nothing else of the
    engine (no isinstance, no attribute of one implementation)."""

    facts: ModelFacts
    # The tokenizer the client detokenizes with, on its event loop; the server's event loop may
    # share it (the text of logprobs), never another thread (it tokenizes prompts with its own).
    tokenizer: Any
    # Called on the event loop with every batch of outputs and every abort (the server's metrics).
    observer: StepObserver | None
    # Called once, on the event loop, when the engine died for good: the server stops and exits 1.
    on_death: Callable[[], None] | None
    # The latest block-map snapshot while watch_block_map(True), else None (the dashboard's grid).
    block_map: BlockMap | None
    dead_error: BaseException | None
    # Engine cores started in place of one that died (``serve --restart-engine-core``).
    core_restarts: int = 0

    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving; call from the event loop that will consume the streams."""

    @abc.abstractmethod
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt: str | None = None) -> RequestStream:
        """Submit a tokenized request and wait until the engine admits it.

        Raises the engine's typed errors (``InvalidRequest``, ``RequestTooLong``, ``QueueFull``,
        ``DuplicateRequestId``) or :class:`EngineDeadError`.
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already ended); its blocks are freed before the next step."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """The engine's latest stats snapshot (never waits for a step)."""

    @abc.abstractmethod
    def watch_block_map(self, on: bool) -> None:
        """Start (or stop) the core's block-map snapshots; the latest lands in ``block_map``.
        They cost the core a bounded share of its loop, so only a watched dashboard turns them on."""

    @abc.abstractmethod
    def load(self) -> LoadReport:
        """Running/waiting requests, KV blocks, tokens/s and the queue wait a new request would see."""

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """True while the engine serves."""

    @abc.abstractmethod
    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``drain_timeout_s``, abort the
        rest, stop the engine. Afterwards it holds no KV blocks."""

    def attach(self, link: Any) -> None:
        """Serve through the core (a ``CoreLink``) a supervisor started in place of a dead one; only
        a client connected with ``restarted_by_supervisor`` takes one."""
        raise TypeError(f"{type(self).__name__} is not restarted by a supervisor")

    def kill(self) -> None:
        """Stop the engine at once, whatever state it is in (after :meth:`shutdown`, or instead of
        it when the server is going down anyway): no engine process outlives the server."""


def queue_wait_estimate(running: int, waiting: int, seats: int, finished_per_s: float, mean_e2e_s: float) -> float:
    """Queue wait for a request arriving now: the seats that must free up before it gets one,
    divided by the rate at which they do (Little's law); without a rate, recent requests' mean
    end-to-end time per seat. Zero while running + waiting leave a seat: a request that has just
    been queued, between its arrival and the next scheduling pass, holds up nobody behind it (a
    snapshot taken in that moment must not tell a router to go elsewhere)."""
    ahead = running + waiting + 1 - seats
    if ahead <= 0:
        return 0.0
    if finished_per_s > 0:
        return ahead / finished_per_s
    return ahead * mean_e2e_s / max(seats, 1)


def log_finished(out: RequestOutput, priority: int) -> None:
    """The ``log_requests`` line of a request that ran to its end (aborted ones are not logged); the
    W6 benchmark reads it back (pagedserve/bench/tiers.py, ``read_request_log``)."""
    m = out.metrics

    def ms(start: float | None, end: float | None) -> str:
        return f"{(end - start) * 1000:.3f}" if start is not None and end is not None else "-"
    request_log.info(
        "request %s finished: priority=%d reason=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d "
        "to_core_ms=%s queue_ms=%s ttft_ms=%s e2e_ms=%s", out.request_id, priority,
        out.outputs[0].finish_reason if out.outputs else "-", len(out.prompt_token_ids),
        sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens,
        ms(m.arrival_time, m.queued_time), ms(m.queued_time, m.first_scheduled_time),
        ms(m.arrival_time, m.first_token_time), ms(m.arrival_time, m.finished_time))
