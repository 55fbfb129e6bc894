"""AsyncEngine: the engine's step loop on its own thread, each request streamed to its own queue.

```
 event loop (server)                          step thread (owns the Engine)
 ───────────────────                          ─────────────────────────────
 add_request() ──▶ command queue ──────────▶  apply adds / aborts between steps
   awaits admission (future) ◀─ result/error ─┤
 RequestStream.__anext__ ◀─ call_soon_threadsafe(deliver, outputs) ◀─ engine.step()
 abort() ─────────▶ command queue ──────────▶  engine.abort(): blocks freed before next step
```

The :class:`~pagedserve.engine.engine.Engine` is not thread-safe, so only the step thread ever
touches it; everything else talks to it through the command list. When there is no work the
thread sleeps on a condition variable (no busy spin). A client that goes away calls
:meth:`AsyncEngine.abort`, which is applied before the next step, so its blocks are freed within
one step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve import errors
from pagedserve.engine.outputs import EngineStats, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.engine import Engine

logger = logging.getLogger(__name__)
# log_requests writes here: one key=value line per finished request, easy to grep or parse.
request_log = logging.getLogger("pagedserve.requests")

# Window over which /load's tokens/s and completion rate are measured.
RATE_WINDOW_S = 10.0
# Engine.stats() walks every running sequence's block table; while busy, refresh the snapshot at
# most this often (and whenever a request finishes or the engine goes idle).
STATS_INTERVAL_S = 0.02


class StepObserver(Protocol):
    """Hooks called on the step thread (metrics use them); they must be quick and never raise."""

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Called after every step with that step's outputs."""

    def on_abort(self, request_id: str, now: float) -> None:
        """Called when a live request is aborted (client gone, shutdown)."""


class EngineDeadError(errors.PagedServeError):
    """The step loop crashed or was shut down; the server cannot take new requests."""

    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"


@dataclass
class LoadReport:
    """The engine's load as the gateway sees it (``GET /load``)."""

    running: int
    waiting: int
    max_num_seqs: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    kv_utilization: float
    tokens_per_s: float
    est_queue_wait_s: float


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    admitted: concurrent.futures.Future[None]
    arrival_time: float  # when the server handed it over: TTFT counts from here, step-boundary wait included


@dataclass
class _Abort:
    request_id: str


_END = object()  # put on a stream's queue when its request was aborted


class RequestStream:
    """Async iterator over one request's :class:`RequestOutput` s, ending after the finished one.

    Use it as ``async with stream: async for out in stream: ...``: leaving the block early (a
    ``break``, an exception, cancellation) aborts the request, so its KV blocks are freed whichever
    way the consumer stops. Cancellation while waiting for an output aborts it too.
    """

    def __init__(self, request_id: str, engine: AsyncEngine, priority: int = 0):
        self.request_id = request_id
        self.priority = priority
        self._engine = engine
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
            self._engine._forget(self.request_id)
        return item

    def abort(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    """Runs :meth:`Engine.step` on a dedicated thread and fans outputs out to per-request queues.

    Create it inside a running event loop (the server's lifespan), then :meth:`start` it. All
    public methods are called from that event loop.
    """

    def __init__(self, engine: Engine, observer: StepObserver | None = None, log_requests: bool = False):
        self.engine = engine
        self.observer = observer
        self.log_requests = log_requests  # one request_log line per request that runs to its end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._thread_done = False  # set under the lock when the step thread exits, however it exits
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # touched on the event loop only
        self._accepting = True
        self.dead_error: BaseException | None = None
        self._stats: EngineStats = engine.stats()
        self._stats_time = 0.0  # step-thread clock of the last refresh
        # (time, generated tokens, finished requests) per step, for rates over RATE_WINDOW_S.
        self._history: collections.deque[tuple[float, int, int]] = collections.deque()
        self._recent_e2e: collections.deque[float] = collections.deque(maxlen=64)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-step", daemon=True)
        self._thread.start()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``drain_timeout_s``, abort
        the rest, stop the thread. Afterwards the engine holds no KV blocks."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self.abort(request_id)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._stats = self.engine.stats()

    @property
    def is_running(self) -> bool:
        """True while the step thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ---- requests --------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit a request and wait for the engine to admit it (between two steps).

        Raises the engine's typed errors (``InvalidRequest``, ``RequestTooLong``, ``QueueFull``,
        ``DuplicateRequestId``) or :class:`EngineDeadError`.
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead_error}")
        if not self._accepting or self._stopping:
            raise EngineDeadError("the server is shutting down; send the request to another replica")
        if request_id in self._streams:
            raise errors.DuplicateRequestId(f"request id {request_id!r} is already running", param="request_id")
        stream = RequestStream(request_id, self, priority)
        self._streams[request_id] = stream
        admitted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(request_id, prompt, params, priority, cache_salt, admitted, time.monotonic()))
        try:
            await asyncio.wrap_future(admitted)
        except BaseException:
            # Refused, or the caller was cancelled while waiting: make sure nothing is left behind.
            self._streams.pop(request_id, None)
            if not admitted.cancelled():
                # It reached the engine: if it was admitted, take it back out (a no-op otherwise).
                self._submit(_Abort(request_id))
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already ended); its blocks are freed before the next step."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream._put(_END)
        self._submit(_Abort(request_id))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            if self._thread_done:  # nobody will ever apply it: refuse now rather than hang the caller
                if isinstance(command, _Add):
                    command.admitted.set_exception(EngineDeadError("the engine is not running"))
                return
            self._commands.append(command)
            self._cond.notify()

    # ---- load ------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of the last step (a snapshot; safe from any thread)."""
        return self._stats

    def load(self) -> LoadReport:
        """Running/waiting requests, KV blocks, tokens/s and the queue wait a new request would see."""
        s = self._stats
        now = time.monotonic()
        history = [h for h in list(self._history) if now - h[0] <= RATE_WINDOW_S]
        span = max(now - history[0][0], 1.0) if history else RATE_WINDOW_S
        tokens_per_s = sum(h[1] for h in history) / span if history else 0.0
        finished_per_s = sum(h[2] for h in history) / span if history else 0.0
        return LoadReport(
            running=s.num_running,
            waiting=s.num_waiting,
            max_num_seqs=s.max_num_seqs,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_cached=s.kv_blocks_cached_free,
            kv_blocks_total=s.kv_blocks_total,
            kv_utilization=s.kv_tokens_in_use / s.kv_slots_allocated if s.kv_slots_allocated else 0.0,
            tokens_per_s=tokens_per_s,
            est_queue_wait_s=self._estimate_queue_wait(s, finished_per_s),
        )

    def _estimate_queue_wait(self, s: EngineStats, finished_per_s: float) -> float:
        """Queue wait for a request arriving now: the requests ahead of it divided by the rate at
        which seats free up (Little's law). Zero when a seat is free and nobody waits."""
        if s.num_waiting == 0 and s.num_running < s.max_num_seqs:
            return 0.0
        ahead = s.num_waiting + 1
        if finished_per_s > 0:
            return ahead / finished_per_s
        # Nothing finished lately: fall back to the mean end-to-end time of recent requests.
        mean_e2e = sum(self._recent_e2e) / len(self._recent_e2e) if self._recent_e2e else 1.0
        return ahead * mean_e2e / max(s.max_num_seqs, 1)

    # ---- step thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                self._apply(commands)
                if stopping:
                    self._stats = engine.stats()
                    with self._cond:
                        self._thread_done = True
                    return
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._after_step(outputs)
                else:
                    self._stats = engine.stats()
        except BaseException as exc:  # the engine is broken: fail every stream, refuse new work
            logger.exception("engine step loop crashed")
            self.dead_error = exc
            self._fail_everything(exc)

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        now = time.monotonic()
        for cmd in commands:
            if isinstance(cmd, _Abort):
                if self.engine.abort(cmd.request_id) and self.observer is not None:
                    self.observer.on_abort(cmd.request_id, now)
                continue
            if not cmd.admitted.set_running_or_notify_cancel():
                continue  # the caller gave up before admission
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority,
                                        cache_salt=cmd.cache_salt, arrival_time=cmd.arrival_time)
            except Exception as exc:
                cmd.admitted.set_exception(exc)
            else:
                cmd.admitted.set_result(None)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        new_tokens = 0
        finished = 0
        for out in outputs:
            new_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
            if out.finished:
                finished += 1
                self._recent_e2e.append(now - out.metrics.arrival_time)
        if finished or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats, self._stats_time = self.engine.stats(), now
        self._history.append((now, new_tokens, finished))
        while self._history and now - self._history[0][0] > RATE_WINDOW_S:
            self._history.popleft()
        if self.observer is not None:
            self.observer.on_outputs(outputs, now)
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # None: aborted meanwhile, the output is dropped
                stream._put(out)
                if out.finished and self.log_requests:
                    _log_finished(out, stream.priority)

    def _fail_everything(self, exc: BaseException) -> None:
        with self._cond:
            self._thread_done = True
            commands, self._commands = self._commands, []
        for cmd in commands:
            if isinstance(cmd, _Add) and not cmd.admitted.done():
                cmd.admitted.set_exception(EngineDeadError(f"engine failed: {exc}"))
        error = EngineDeadError(f"the engine failed while serving this request: {exc}")

        def fail_streams() -> None:
            for stream in list(self._streams.values()):
                stream._put(error)
            self._streams.clear()

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fail_streams)


_REQUEST_LINE = re.compile(r"request (\S+) finished: .*queue_ms=(\S+) ttft_ms=(\S+)")


def read_request_log(path: Path) -> dict[str, tuple[float, float]]:
    """request id → (engine queue time, engine TTFT) in seconds, from the ``log_requests`` lines
    :func:`_log_finished` writes (the format and its reader kept together)."""
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        m = _REQUEST_LINE.search(line)
        if m and m.group(2) != "-" and m.group(3) != "-":
            out[m.group(1)] = (float(m.group(2)) / 1000, float(m.group(3)) / 1000)
    return out


def _log_finished(out: RequestOutput, priority: int) -> None:
    """The ``log_requests`` line of a request that ran to its end (aborted ones are not logged)."""
    m = out.metrics

    def ms(start: float | None, end: float | None) -> str:
        return f"{(end - start) * 1000:.3f}" if start is not None and end is not None else "-"
    request_log.info(
        "request %s finished: priority=%d reason=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d "
        "queue_ms=%s ttft_ms=%s e2e_ms=%s", out.request_id, priority,
        out.outputs[0].finish_reason if out.outputs else "-", len(out.prompt_token_ids),
        sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens,
        ms(m.queued_time, m.first_scheduled_time), ms(m.arrival_time, m.first_token_time),
        ms(m.arrival_time, m.finished_time))
