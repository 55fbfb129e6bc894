"""MPEngineClient: the engine core in its own process, the text side on the server's event loop.

```
 server process: event loop                                     core process (core/proc.py)
 ──────────────────────────                                     ───────────────────────────
 EngineClient._send ── AddRequest / Abort ──▶ PUSH ════ ipc ════▶ PULL ──▶ CoreLoop
 output task: PULL ◀════ ipc ════ PUSH ◀── CoreBatch (admissions, token-id outputs, stats)
   EngineClient._handle: admissions, OutputProcessor (text, stop strings), RequestStream queues
 death watch: the process's sentinel fd on the loop ──▶ every stream fails at once, on_death()
```

Over :class:`~pagedserve.engine.frontend.client.EngineClient` this module adds the sockets, the
death watch and the restart of a dead core; it attaches to a loaded core (``CoreLaunch.wait_ready``)
in :meth:`MPEngineClient.start`, inside the event loop.

With ``num_fronts`` N > 1 (``serve --api-server-count N``) the core gets one socket pair per
front end, and each front, in a process of its own, attaches through a :class:`CoreLink`: the
addresses of its pair, the model's facts and the core's pid. A front does not own the core: it
never stops it (the process that started it does), and it learns of its death from a pidfd
(Linux), which becomes readable the moment the core exits, as the sentinel does for the parent.

With a :class:`~pagedserve.engine.frontend.core_restart.CoreRestarter` (``serve --restart-engine-core``)
the client that owns the core replaces it when it dies: the open requests fail as always, new
ones get 503 while a core with the same config loads on the same socket addresses (the client's
bound sockets take its connections), then the client serves through it. When the restarter's
budget is spent, or the new core fails to load, the death is final (``on_death``). A front of
several (``restarted_by_supervisor``) only fails its requests and waits: the supervisor restarts
the core and hands it the new one with :meth:`MPEngineClient.attach`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from pagedserve.engine.frontend.client import EngineClient, EngineDeadError, idle_stats
from pagedserve.engine.frontend.core_launch import CoreLaunch, CoreLink, CoreProcess
from pagedserve.engine.frontend.core_restart import CoreRestarter, describe_exit
from pagedserve.engine.wire import Abort, AddRequest, CoreBatch, Shutdown, WatchBlocks
from pagedserve.tokenizer import TokenizerPreload, load_tokenizer

logger = logging.getLogger(__name__)


class MPEngineClient(EngineClient):
    """The :class:`EngineClient` over a core process. All methods run on one event loop."""

    def __init__(self, core: CoreProcess | CoreLink, log_requests: bool = False, restarter: CoreRestarter | None = None,
                 restarted_by_supervisor: bool = False, preload: TokenizerPreload | None = None):
        super().__init__(core.facts, load_tokenizer(core.facts.tokenizer, preload=preload), log_requests)
        self.core = core
        assert restarter is None or core.owned, "only the client that started the engine core can restart it"
        self.restarter = restarter
        # A front of `serve --api-server-count N --restart-engine-core`: the supervisor restarts the
        # core and hands the new one over through attach(); a death only fails the open requests.
        self.restarted_by_supervisor = restarted_by_supervisor
        self._restarting = False  # between a core's death and its replacement's attach
        self._restart_task: asyncio.Task[None] | None = None
        self._launch: CoreLaunch | None = None  # a replacement core while it loads
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreBatch)
        self._ctx: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        # One front among several sees only its own requests' outputs: /load's rates then come from
        # the engine-wide counters in the core's stats instead, so every front reports the same.
        self._rates_from_stats = not core.owned

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if isinstance(self.core, CoreLink):
            self.core.open()
        self._ctx = zmq.asyncio.Context(io_threads=1)
        input_addr, output_addr = self.core.addrs[0]  # this front's pair (a CoreLink holds only it)
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_addr)
        output = self._ctx.socket(zmq.PULL)
        output.bind(output_addr)
        self._loop.add_reader(self.core.sentinel, self._core_exited)
        self._reader = asyncio.create_task(self._read_outputs(output), name="pagedserve-core-outputs")

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        await self._drain(drain_timeout_s)
        if self._restart_task is not None:  # a replacement still loading: kill it, let the task see that
            if self._launch is not None:
                self._launch.process.kill()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        if self.core.owned and self.core.is_alive() and self.dead_error is None:
            self._send(Shutdown())
            deadline = time.monotonic() + 10
            while self.core.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if self._loop is not None:
            self._loop.remove_reader(self.core.sentinel)
        self.core.kill()
        if self._reader is not None:
            self._reader.cancel()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # its sockets too
        self.core.cleanup()

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and self.core.is_alive() and not self._shutting_down

    def kill(self) -> None:
        self.core.kill()

    # ---- requests --------------------------------------------------------------------------

    def _send(self, command: AddRequest | Abort | Shutdown | WatchBlocks) -> None:
        assert self._input is not None
        # A batch of one: the core decodes list[Command] frames. PUSH never blocks here (the
        # high-water mark is far above anything one server holds in flight).
        self._input.send(self._encoder.encode([command]), copy=False)

    def _check_accepting(self, request_id: str) -> None:
        if self._restarting and not self._shutting_down:
            raise EngineDeadError("the engine core is restarting after its process died; retry in a few seconds")
        super()._check_accepting(request_id)

    # ---- outputs ---------------------------------------------------------------------------

    async def _read_outputs(self, output: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frame = await output.recv(copy=False)
                self._handle(self._decoder.decode(frame.buffer))
        except Exception as exc:  # a message we cannot read (not shutdown's CancelledError, a BaseException)
            # The core and we disagree: stop serving.
            logger.exception("reading the engine core's outputs failed")
            self._die(EngineDeadError(f"lost the engine core's output stream: {exc}"))

    def _handle(self, batch: CoreBatch) -> None:
        if self._restarting:
            # The dead core's last frames (its requests are failed already; its stats are no
            # longer true); a replacement sends nothing before it is attached and given work.
            return
        super()._handle(batch)

    # ---- the core's death ------------------------------------------------------------------

    def _core_exited(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.core.sentinel)
        if self._shutting_down:
            return
        how = describe_exit(self.core.exit_code())
        if self.restarted_by_supervisor:
            logger.error("the engine core process died: failing %d open requests until the supervisor has "
                         "started a new one", len(self._streams))
            self._begin_restart("the engine core process died")
            return
        budget = self.restarter.budget if self.restarter is not None else None
        if budget is not None and budget.take():
            logger.error("the engine core process (pid %s) died (%s): failing %d open requests, starting a new "
                         "core (restarts allowed: %d per %.0f s)", self.core.process.pid, how, len(self._streams),
                         budget.max_restarts, budget.window_s)
            self._begin_restart(f"the engine core process died ({how})")
            self._restart_task = asyncio.create_task(self._restart(), name="pagedserve-core-restart")
            return
        spent = "" if budget is None else (f" and the {budget.max_restarts} restarts allowed per {budget.window_s:.0f}"
                                           " s are spent (--engine-core-max-restarts): giving up")
        logger.error("the engine core process died (%s)%s; failing %d open requests, refusing new ones", how, spent,
                     len(self._streams))
        self._die(EngineDeadError(f"the engine core process died ({how}); "
                                  "this server is restarting, retry on another replica"))

    def _begin_restart(self, what: str) -> None:
        self._fail(EngineDeadError(f"{what}; it is restarting, retry in a few seconds or on another replica"))
        self._stats = idle_stats(self.facts)  # its KV blocks went with it: /metrics shows none in use
        self._restarting = True

    # ---- a replacement core (--restart-engine-core) ------------------------------------------

    async def _restart(self) -> None:
        assert self.restarter is not None and isinstance(self.core, CoreProcess)
        started = time.monotonic()
        try:
            self._launch = self.restarter.respawn(self.core)
            core = await asyncio.to_thread(self._launch.wait_ready)
        except Exception as exc:  # noqa: BLE001 - EngineStartupError (its one-line reason), or the spawn failed
            if not self._shutting_down:
                logger.error("the new engine core failed to start (%s): giving up", exc)
                self._restarting = False
                self._die(EngineDeadError(f"the engine core died and could not be restarted: {exc}"))
            return
        finally:
            self._launch = None
        if self._shutting_down or self._dead:  # no longer wanted (shutting down, or given up meanwhile)
            core.kill()
            return
        self._restart_task = None
        self._attach(core)
        logger.warning("engine core restarted in process %d after %.1f s (restart %d)", core.process.pid,
                       time.monotonic() - started, self.core_restarts)

    def attach(self, link: CoreLink) -> None:
        """Serve through the core a supervisor started in place of the dead one (``restarted_by_supervisor``)."""
        assert self._loop is not None and self.restarted_by_supervisor
        if self._shutting_down or self._dead:
            return
        if not self._restarting:  # the news of the new core came before the old one's death was seen
            self._loop.remove_reader(self.core.sentinel)
            self._begin_restart("the engine core process died")
        self.core.cleanup()  # the dead core's pidfd
        link.open()
        self._attach(link)
        logger.warning("serving through the new engine core (process %d)", link.pid)

    def _attach(self, core: CoreProcess | CoreLink) -> None:
        """Serve through ``core`` from now on: a fresh engine, so idle stats and no block map."""
        assert self._loop is not None
        if core.facts != self.facts:
            logger.warning("the new engine core's model facts differ from the old one's: %s", core.facts)
        self.core = core
        self.facts = core.facts
        self._stats = idle_stats(core.facts)
        self._last_counts = None  # its cumulative counters start again from zero
        self.block_map = None
        self._loop.add_reader(core.sentinel, self._core_exited)
        self.core_restarts += 1
        self.dead_error = None
        self._restarting = False
        if self._watching_blocks:
            self._send(WatchBlocks(True))

