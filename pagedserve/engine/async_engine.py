"""AsyncEngine: the in-process :class:`EngineClient`, the whole Engine on a step thread.

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
thread sleeps on a condition variable (no busy spin). It shares the server's process, GIL and
fate: the server uses :class:`~pagedserve.engine.mp_client.MPEngineClient` unless told otherwise;
tests and embedders use this one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.block_map import BlockMapFeed
from pagedserve.engine.client import (
    EngineDeadError, LoadReport, RequestStream, StepObserver, StreamingClient, read_request_log, request_log,
)
from pagedserve.engine.outputs import EngineStats, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.engine import Engine

__all__ = ["AsyncEngine", "EngineDeadError", "LoadReport", "RequestStream", "StepObserver", "read_request_log",
           "request_log"]

logger = logging.getLogger(__name__)

# Engine.stats() walks every running sequence's block table; while busy, refresh the snapshot at
# most this often (and whenever a request finishes or the engine goes idle).
STATS_INTERVAL_S = 0.02


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


@dataclass
class _Watch:
    on: bool  # start or stop making block-map snapshots


class AsyncEngine(StreamingClient):
    """Runs :meth:`Engine.step` on a dedicated thread and fans outputs out to per-request queues.

    Create it inside a running event loop (the server's lifespan), then :meth:`start` it. All
    public methods are called from that event loop.
    """

    def __init__(self, engine: Engine, observer: StepObserver | None = None, log_requests: bool = False):
        super().__init__(observer, log_requests)
        self.engine = engine
        self.facts = engine.facts()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Watch] = []
        self._stopping = False
        self._thread_done = False  # set under the lock when the step thread exits, however it exits
        self._thread: threading.Thread | None = None
        self._stats: EngineStats = engine.stats()
        self._stats_time = 0.0  # step-thread clock of the last refresh
        self._block_feed = BlockMapFeed()  # touched by the step thread only

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-step", daemon=True)
        self._thread.start()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        await self._drain(drain_timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._stats = self.engine.stats()
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ---- requests --------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt_token_ids: str | list[int], params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          prompt: str | None = None) -> RequestStream:
        if self._stopping:
            raise EngineDeadError("the server is shutting down; send the request to another replica")
        stream = self._check_accepting(request_id)
        stream.priority = priority
        self._streams[request_id] = stream
        admitted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(request_id, prompt_token_ids, params, priority, cache_salt, admitted, time.monotonic()))
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

    def _abort_in_engine(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    def watch_block_map(self, on: bool) -> None:
        self._submit(_Watch(on))

    def _submit(self, command: _Add | _Abort | _Watch) -> None:
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
                    self._snapshot_blocks(time.monotonic(), idle=True)
        except BaseException as exc:  # the engine is broken: fail every stream, refuse new work
            logger.exception("engine step loop crashed")
            self.dead_error = exc
            self._fail_everything(exc)

    def _apply(self, commands: list[_Add | _Abort | _Watch]) -> None:
        now = time.monotonic()
        for cmd in commands:
            if isinstance(cmd, _Watch):
                self._block_feed.watch(cmd.on)
                continue
            if isinstance(cmd, _Abort):
                if self.engine.abort(cmd.request_id) and self.observer is not None:
                    self._call_soon(self.observer.on_abort, cmd.request_id, now)
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
        if any(out.finished for out in outputs) or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats, self._stats_time = self.engine.stats(), now
        if outputs:
            self._call_soon(self._deliver, outputs)
        self._snapshot_blocks(now, idle=not self.engine.has_unfinished_requests())

    def _snapshot_blocks(self, now: float, idle: bool) -> None:
        snap = self._block_feed.maybe_build(self.engine, now, idle)
        if snap is not None:
            self.block_map = snap  # one reference swap: the event loop reads whichever is current

    def _call_soon(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _fail_everything(self, exc: BaseException) -> None:
        with self._cond:
            self._thread_done = True
            commands, self._commands = self._commands, []
        for cmd in commands:
            if isinstance(cmd, _Add) and not cmd.admitted.done():
                cmd.admitted.set_exception(EngineDeadError(f"engine failed: {exc}"))
        self._call_soon(self._fail_streams, EngineDeadError(f"the engine failed while serving this request: {exc}"))
