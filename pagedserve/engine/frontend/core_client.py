"""CoreClient: the front end's half of an engine client, whatever carries its messages to the core.

```
 event loop (server)                                     the core loop (engine/core/loop.py)
 ───────────────────                                     ───────────────────────────────────
 add_request() ── AddRequest ──▶ _send ──▶ transport ──▶ EngineCore.add_request
   awaits its Admission ◀── _handle(CoreBatch) ◀── transport ◀── admissions, outputs, stats
   OutputProcessor: text, stop strings ──▶ RequestStream queues; a stop string hit ──▶ Abort(index)
```

The two clients (a thread of this process, or ZMQ sockets to the core's process) differ only in
the transport; detokenization, stop strings, admissions and the load report are this module's, once.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from pagedserve import errors
from pagedserve.engine.block_map import BlockMap
from pagedserve.engine.frontend.client import (_END, RATE_WINDOW_S, EngineClient, EngineDeadError, LoadReport,
                                               RequestStream, StepObserver, log_finished, queue_wait_estimate)
from pagedserve.engine.frontend.output_processor import OutputProcessor
from pagedserve.engine.outputs import EngineStats, RequestOutput
from pagedserve.engine.frontend.request_check import check_request
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.wire import Abort, AddRequest, CoreBatch, ModelFacts, Shutdown, WatchBlocks

logger = logging.getLogger(__name__)


class CoreClient(EngineClient):
    """An :class:`EngineClient` whose core runs a :class:`~pagedserve.engine.core.loop.CoreLoop`.
    All methods run on one event loop; :meth:`_handle` must be called there with every batch the
    core sends, and :meth:`_send` delivers a command to the core."""

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

    # ---- requests --------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt: str | None = None) -> RequestStream:
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

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream._put(_END)
        self.output_processor.abort(request_id)
        if self.dead_error is None and not self._shutting_down:
            self._send(Abort(request_id))

    def watch_block_map(self, on: bool) -> None:
        self._watching_blocks = on
        if not on:
            self.block_map = None  # stale once nobody watches: the next viewer waits for a fresh one
        if self.dead_error is None and not self._shutting_down:
            self._send(WatchBlocks(on))

    def stats(self) -> EngineStats:
        return self._stats

    def load(self) -> LoadReport:
        s = self.stats()
        now = time.monotonic()
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
                stream._put(out)
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
            stream._put(error)
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


def idle_stats(f: ModelFacts) -> EngineStats:
    """An idle pool's stats, shown until a core sends its first."""
    return EngineStats(max_num_seqs=f.max_num_seqs, max_model_len=f.max_model_len, block_size=f.block_size,
                       kv_blocks_total=f.num_kv_blocks, kv_bytes_per_token=f.kv_bytes_per_token)
