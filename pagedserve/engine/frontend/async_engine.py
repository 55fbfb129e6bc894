"""AsyncEngine: the in-process :class:`EngineClient`, the core loop on a thread of this process.

```
 event loop (server)                                   step thread (owns the EngineCore)
 ───────────────────                                   ─────────────────────────────────
 EngineClient._send ──▶ command list (condition) ────▶ CoreLoop: apply, step, send
 EngineClient._handle ◀── call_soon_threadsafe(CoreBatch) ◀──┘
```

The same core loop and :class:`~pagedserve.engine.frontend.client.EngineClient` as the
multiprocess client; only the transport differs (no encoding; the thread sleeps on the condition
when there is no work). The core is not thread-safe, so only the step thread touches it while the
client runs. It shares the server's process, GIL and fate: the server uses the multiprocess client
unless told otherwise; tests, embedders and Ray replicas use this one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.engine.frontend.client import EngineClient, EngineDeadError
from pagedserve.engine.core.loop import CoreLoop
from pagedserve.engine.wire import AddRequest, Command, CoreBatch, Shutdown
from pagedserve.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pagedserve.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)


class _ThreadTransport:
    """The core loop's transport within one process: commands under a condition, batches to a callback."""

    num_fronts = 1

    def __init__(self, deliver: Callable[[CoreBatch], None]):
        self._deliver = deliver
        self._cond = threading.Condition()
        self._commands: list[Command] = []
        self._closed = False  # the loop has exited: nobody will apply a command

    def put(self, command: Command) -> bool:
        """Queue a command for the loop; False if the loop is gone."""
        with self._cond:
            if self._closed:
                return False
            self._commands.append(command)
            self._cond.notify()
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True

    def wait(self) -> None:
        with self._cond:
            while not self._commands:
                self._cond.wait()

    def receive(self) -> list[tuple[int, Command]]:
        with self._cond:
            commands, self._commands = self._commands, []
        return [(0, cmd) for cmd in commands]

    def send(self, front: int, batch: CoreBatch) -> None:
        self._deliver(batch)

    def check(self, now: float) -> None:
        pass  # the loop lives and dies with this process


class AsyncEngine(EngineClient):
    """Runs a :class:`~pagedserve.engine.core.loop.CoreLoop` over ``core`` on a dedicated thread;
    :meth:`start` it inside the event loop that will consume the streams, and call it only there."""

    def __init__(self, core: EngineCore, log_requests: bool = False):
        super().__init__(core.facts(), load_tokenizer(core.tokenizer_source), log_requests)
        self.core = core
        self._transport = _ThreadTransport(functools.partial(self._call_soon, self._handle))  # on the step thread
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-step", daemon=True)
        self._thread.start()

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        await self._drain(drain_timeout_s)
        self._transport.put(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._stats = self.core.stats()  # the thread is gone: the core is ours to read
        self.core.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None \
            and not self._shutting_down

    # ---- transport -------------------------------------------------------------------------

    def _send(self, command: Command) -> None:
        if not self._transport.put(command) and isinstance(command, AddRequest):
            # Nobody will ever apply it: refuse now rather than leave the caller waiting.
            future = self._admissions.pop(command.request_id, None)
            if future is not None and not future.done():
                future.set_exception(EngineDeadError("the engine is not running"))

    def _call_soon(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        try:
            CoreLoop(self.core, self._transport).run()
        except BaseException as exc:  # the core is broken: fail every stream, refuse new work
            logger.exception("engine step loop crashed")
            self._call_soon(self._die, EngineDeadError(f"the engine failed while serving this request: {exc}"))
        finally:
            self._transport.close()
