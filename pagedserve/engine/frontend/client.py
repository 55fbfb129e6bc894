"""EngineClient: all a server (or anything else that serves) knows of the engine, written once.

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

Inside, whatever carries the messages to the core loop (engine/core/loop.py)::

 event loop (server)                                     the core loop
 ───────────────────                                     ─────────────
 add_request() ── AddRequest ──▶ _send ──▶ transport ──▶ EngineCore.add_request
   awaits its Admission ◀── _handle(CoreBatch) ◀── transport ◀── admissions, outputs, stats
   OutputProcessor: text, stop strings ──▶ RequestStream queues; a stop string hit ──▶ Abort(index)

Its two subclasses (:mod:`~pagedserve.engine.frontend.async_engine`: the core loop on a thread of this
process; :mod:`~pagedserve.engine.frontend.mp_client`: the core in its own process, over ZMQ) differ only
in the transport; detokenization, stop strings, admissions and the load report are this module's, once.
They are built by :mod:`pagedserve.engine.frontend.factory`. Every method is called from the one event
loop that consumes the streams.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve import errors
from pagedserve.engine.block_map import BlockMap
from pagedserve.engine.frontend.output_processor import OutputProcessor
from pagedserve.engine.frontend.request_check import check_request
from pagedserve.engine.outputs import EngineStats, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.wire import Abort, AddRequest, CoreBatch, ModelFacts, Shutdown, WatchBlocks

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

    def __init__(self, request_id: str, client: EngineClient, priority: int = 0):
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
            self._client._streams.pop(self.request_id, None)
            if item.error is not None:
                raise RequestFailed(f"the engine failed while processing this request ({item.error}); "
                                    "other requests were not affected, retry it")
        return item

    def abort(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)


class EngineClient(abc.ABC):
    """The engine as a server sees it: submit, stream, abort, load, stats and the model's facts.

    Its public methods and attributes are everything a server reads or sets on a client; it needs
    nothing else of the engine (no isinstance, no attribute of one subclass). A subclass is a
    transport to a :class:`~pagedserve.engine.core.loop.CoreLoop`: it :meth:`start` s and
    :meth:`shutdown` s it, delivers each command with :meth:`_send`, and calls :meth:`_handle` on the
    event loop with every batch the core sends."""

    # Engine cores started in place of one that died (``serve --restart-engine-core``).
    core_restarts: int = 0

    def __init__(self, facts: ModelFacts, tokenizer: Any, log_requests: bool = False):
        self.facts = facts
        # The front end's tokenizer for the event loop (detokenization here, the text of logprobs in
        # the server); the server tokenizes prompts with others, on its worker thread.
        self.tokenizer = tokenizer
        self.observer: StepObserver | None = None  # the server's metrics, set after construction
        self.on_death: Callable[[], None] | None = None  # the server's exit, set after construction
        self.log_requests = log_requests  # one request_log line per request that runs to its end
        self.dead_error: BaseException | None = None
        self.block_map: BlockMap | None = None  # the latest snapshot while watch_block_map(True)
        self.output_processor = OutputProcessor(tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._stats = idle_stats(facts)  # until the core's first stats arrive
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self._shutting_down = False
        self._dead = False  # for good: no restart follows
        self._watching_blocks = False
        # (time, generated tokens, finished requests) per delivery, for rates over RATE_WINDOW_S.
        self._history: collections.deque[tuple[float, int, int]] = collections.deque()
        self._recent_e2e: collections.deque[float] = collections.deque(maxlen=64)
        self._rates_from_stats = False  # True: the rates come from the core's counters (not per delivery)
        self._last_counts: tuple[int, int] | None = None

    @abc.abstractmethod
    def _send(self, command: AddRequest | Abort | Shutdown | WatchBlocks) -> None:
        """Deliver one command to the core loop (never blocks)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving; call from the event loop that will consume the streams."""

    @abc.abstractmethod
    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``drain_timeout_s``, abort the
        rest, stop the engine. Afterwards it holds no KV blocks."""

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """True while the engine serves."""

    def attach(self, link: Any) -> None:
        """Serve through the core (a ``CoreLink``) a supervisor started in place of a dead one; only
        a client connected with ``restarted_by_supervisor`` takes one."""
        raise TypeError(f"{type(self).__name__} is not restarted by a supervisor")

    def kill(self) -> None:
        """Stop the engine at once, whatever state it is in (after :meth:`shutdown`, or instead of
        it when the server is going down anyway): no engine process outlives the server."""

    # ---- requests --------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt: str | None = None) -> RequestStream:
        """Submit a tokenized request and wait until the engine admits it.

        Raises the engine's typed errors (``InvalidRequest``, ``RequestTooLong``, ``QueueFull``,
        ``DuplicateRequestId``) or :class:`EngineDeadError`.
        """
        self._check_accepting(request_id)
        check_request(self.facts, prompt_token_ids, params)  # the front end's one check; the core trusts it
        stream = RequestStream(request_id, self, priority)
        assert self._loop is not None, "start() the client first"
        admitted: asyncio.Future[None] = self._loop.create_future()
        self._admissions[request_id] = admitted
        self._streams[request_id] = stream
        self.output_processor.add(request_id, prompt_token_ids, params, prompt)
        self._send(AddRequest(request_id, list(prompt_token_ids), params, priority, cache_salt, time.monotonic()))
        try:
            await admitted
        except BaseException:
            # Refused, or the caller gave up while waiting: take it back out (a no-op if refused).
            self._admissions.pop(request_id, None)
            self._streams.pop(request_id, None)
            self.output_processor.abort(request_id)
            if self.dead_error is None:
                self._send(Abort(request_id))
            raise
        return stream

    def _check_accepting(self, request_id: str) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead_error}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down; send the request to another replica")
        if request_id in self._streams:
            raise errors.DuplicateRequestId(f"request id {request_id!r} is already running", param="request_id")

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already ended); its blocks are freed before the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream._queue.put_nowait(_END)
        self.output_processor.abort(request_id)
        if self.dead_error is None and not self._shutting_down:
            self._send(Abort(request_id))

    def watch_block_map(self, on: bool) -> None:
        """Start (or stop) the core's block-map snapshots; the latest lands in ``block_map``.
        They cost the core a bounded share of its loop, so only a watched dashboard turns them on."""
        self._watching_blocks = on
        if not on:
            self.block_map = None  # stale once nobody watches: the next viewer waits for a fresh one
        if self.dead_error is None and not self._shutting_down:
            self._send(WatchBlocks(on))

    def stats(self) -> EngineStats:
        """The engine's latest stats snapshot (never waits for a step)."""
        return self._stats

    def load(self) -> LoadReport:
        """Running/waiting requests, KV blocks, tokens/s and the queue wait a new request would see."""
        s, now = self.stats(), time.monotonic()
        history = [h for h in list(self._history) if now - h[0] <= RATE_WINDOW_S]
        span = max(now - history[0][0], 1.0) if history else RATE_WINDOW_S
        tokens_per_s = sum(h[1] for h in history) / span if history else 0.0
        finished_per_s = sum(h[2] for h in history) / span if history else 0.0
        mean_e2e = sum(self._recent_e2e) / len(self._recent_e2e) if self._recent_e2e else 1.0
        return LoadReport(
            running=s.num_running, waiting=s.num_waiting, max_num_seqs=s.max_num_seqs,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_cached=s.kv_blocks_cached_free,
            kv_blocks_total=s.kv_blocks_total, kv_utilization=s.kv_utilization, tokens_per_s=tokens_per_s,
            est_queue_wait_s=queue_wait_estimate(s.num_running, s.num_waiting, s.max_num_seqs, finished_per_s,
                                                 mean_e2e))

    # ---- what the core sends ---------------------------------------------------------------

    def _handle(self, batch: CoreBatch) -> None:
        for admission in batch.admissions:
            future = self._admissions.pop(admission.request_id, None)
            if future is None or future.done():
                continue
            if admission.error_class is None:
                future.set_result(None)
            else:
                future.set_exception(admission.to_exception())
        if batch.stats is not None:
            self._stats = batch.stats
            if self._rates_from_stats:
                self._count_from_stats(batch.stats)
        if batch.block_map is not None and self._watching_blocks:
            self.block_map = batch.block_map
        if self.observer is not None and batch.aborted:
            now = time.monotonic()
            for request_id in batch.aborted:
                self.observer.on_abort(request_id, now)
        if batch.outputs:
            processed = self.output_processor.process(batch.outputs)
            for request_id, index in processed.finish_in_core:
                self._send(Abort(request_id, index))
            if processed.outputs:
                self._deliver(processed.outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a batch of outputs to their streams (on the event loop); feed the rates and observer."""
        now = time.monotonic()
        new_tokens = finished = 0
        for out in outputs:
            new_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
            if out.finished:
                finished += 1
                self._recent_e2e.append(now - out.metrics.arrival_time)
            stream = self._streams.get(out.request_id)
            if stream is not None:  # None: aborted meanwhile, the output is dropped
                stream._queue.put_nowait(out)
                if out.finished and self.log_requests and out.error is None:
                    log_finished(out, stream.priority)
        if not self._rates_from_stats:
            self._record_rates(now, new_tokens, finished)
        if self.observer is not None:
            self.observer.on_outputs(outputs, now)

    def _record_rates(self, now: float, new_tokens: int, finished: int) -> None:
        self._history.append((now, new_tokens, finished))
        while self._history and now - self._history[0][0] > RATE_WINDOW_S:
            self._history.popleft()

    def _count_from_stats(self, s: EngineStats) -> None:
        """Feed /load's rate window from the core's cumulative counters (tokens sampled, requests ended)."""
        counts = (s.generation_tokens, s.ended_requests)
        if self._last_counts is not None:
            self._record_rates(time.monotonic(), counts[0] - self._last_counts[0], counts[1] - self._last_counts[1])
        self._last_counts = counts

    # ---- failure ---------------------------------------------------------------------------

    def _fail(self, error: EngineDeadError) -> None:
        """End every open request and admission with ``error``; refuse new ones until cleared."""
        self.dead_error = error
        for future in self._admissions.values():
            if not future.done():
                future.set_exception(error)
        self._admissions.clear()
        self.output_processor.requests.clear()  # their late tokens, if any still arrive, are dropped
        for stream in list(self._streams.values()):
            stream._queue.put_nowait(error)
        self._streams.clear()

    async def _drain(self, drain_timeout_s: float) -> None:
        """Stop accepting; wait up to ``drain_timeout_s`` for open streams; abort the rest; from then on
        the client is shutting down (it sends the core no more aborts)."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline and self.dead_error is None:
            await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self.abort(request_id)
        self._shutting_down = True

    def _die(self, error: EngineDeadError) -> None:
        """The core is gone for good: fail everything, tell the server (once)."""
        if self._dead:
            return
        self._dead = True
        self._fail(error)
        if self.on_death is not None:
            self.on_death()


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


def idle_stats(f: ModelFacts) -> EngineStats:
    """An idle pool's stats, shown until a core sends its first."""
    return EngineStats(max_num_seqs=f.max_num_seqs, max_model_len=f.max_model_len, block_size=f.block_size,
                       kv_blocks_total=f.num_kv_blocks, kv_bytes_per_token=f.kv_bytes_per_token)
