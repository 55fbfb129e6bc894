"""The engine core's busy loop, written once: apply commands → step → send what each front is owed.

```
 transport.wait()      only while the core has no work (blocks: no busy spin)
 transport.receive()   AddRequest / Abort / WatchBlocks / Shutdown, from any front end
 core.step()           one scheduled batch (engine/core/engine_core.py)
 transport.send(i, CoreBatch)   admissions, token-id outputs, stats, block map: per front i
```

Two transports drive it, and nothing else steps a core that serves clients: the core process's
ZMQ sockets (:mod:`pagedserve.engine.core.proc`) and the in-process client's thread.

With several front ends (``--api-server-count N``) the loop remembers which front added each
request and sends that request's admission and outputs back to it alone; the stats snapshot goes
to every front, so each answers /load and /metrics with the same engine-wide figures. An Abort is
applied only for the front that owns the request (a request id refused as a duplicate must not
let its sender abort another front's request of that id).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from pagedserve import errors
from pagedserve.engine.core.block_map_feed import BlockMapFeed
from pagedserve.engine.wire import Abort, AddRequest, Admission, Command, CoreBatch, Shutdown, WatchBlocks

if TYPE_CHECKING:
    from pagedserve.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

# While busy, send the stats snapshot at most this often (and whenever a request finishes or the
# core runs out of work): EngineCore.stats() goes over every running sequence's block table
# (BlockManager.tokens_in_use: ~0.05 ms at 64 sequences).
STATS_INTERVAL_S = 0.02


class Transport(Protocol):
    """How commands reach the loop and batches leave it."""

    num_fronts: int

    def wait(self) -> None:
        """Block until a command may have arrived (called only while the core has no work)."""

    def receive(self) -> list[tuple[int, Command]]:
        """Every command that has arrived, with the index of the front that sent it (never blocks)."""

    def send(self, front: int, batch: CoreBatch) -> None:
        """Hand ``batch`` to front end ``front``."""

    def check(self, now: float) -> None:
        """Called once per pass: raise to stop serving (the core process's parent is gone)."""


class CoreLoop:
    """Serves one :class:`EngineCore` through a :class:`Transport` until a Shutdown command."""

    def __init__(self, core: EngineCore, transport: Transport):
        self.core = core
        self.transport = transport
        self.owner: dict[str, int] = {}  # request id -> the front that added it
        self.watching: set[int] = set()  # fronts that watch the block map
        self.blocks = BlockMapFeed()
        self._batches = [CoreBatch() for _ in range(transport.num_fronts)]
        self._last_stats = 0.0

    def run(self) -> None:
        core = self.core
        while True:
            if not core.has_unfinished_requests():
                self.transport.wait()
            self._batches = [CoreBatch() for _ in self._batches]
            for front, cmd in self.transport.receive():
                if isinstance(cmd, Shutdown):  # what this pass applied goes out, with the final stats
                    stats = self.core.stats()
                    for batch in self._batches:
                        batch.stats = stats
                    self._flush()
                    return
                self._apply(front, cmd)
            try:
                self._step()
            finally:  # a step that raises ends the loop, but the pass's admissions still go out first
                self._flush()

    def _flush(self) -> None:
        for front, batch in enumerate(self._batches):
            if batch != CoreBatch():  # something to say
                self.transport.send(front, batch)

    def _step(self) -> None:
        core = self.core
        outputs = core.step() if core.has_unfinished_requests() else []
        for out in outputs:
            front = self.owner.pop(out.request_id, None) if out.finished else self.owner.get(out.request_id)
            if front is not None:
                self._batches[front].outputs.append(out)
        now = time.monotonic()
        self.transport.check(now)
        idle = not core.has_unfinished_requests()
        if idle or any(o.finished for o in outputs) or now - self._last_stats >= STATS_INTERVAL_S:
            stats, self._last_stats = core.stats(), now
            for batch in self._batches:
                batch.stats = stats
        block_map = self.blocks.maybe_build(core, now, idle)
        if block_map is not None:
            for front in self.watching:
                self._batches[front].block_map = block_map

    def _apply(self, front: int, cmd: Command) -> None:
        if isinstance(cmd, WatchBlocks):
            (self.watching.add if cmd.on else self.watching.discard)(front)
            if cmd.on or not self.watching:
                self.blocks.watch(bool(self.watching))  # a new viewer: a snapshot is owed
        elif isinstance(cmd, Abort):
            self._abort(front, cmd)
        elif isinstance(cmd, AddRequest):
            self._add(front, cmd)

    def _abort(self, front: int, cmd: Abort) -> None:
        if self.owner.get(cmd.request_id) != front:
            return  # not this front's request (already ended, or another front's of the same id)
        if self.core.abort(cmd.request_id, cmd.index) and cmd.index is None:
            self._batches[front].aborted.append(cmd.request_id)
        if cmd.request_id not in self.core.requests:  # gone (waiting, compiling or running no more)
            del self.owner[cmd.request_id]

    def _add(self, front: int, cmd: AddRequest) -> None:
        admissions = self._batches[front].admissions
        try:
            self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority, cmd.cache_salt,
                                  cmd.arrival_time)
        except errors.PagedServeError as exc:
            admissions.append(Admission(cmd.request_id, type(exc).__name__, exc.message, exc.param,
                                        getattr(exc, "retry_after_s", None)))
        except Exception as exc:  # a bug, not the client's fault: refuse this one request, keep serving
            logger.exception("adding request %s failed", cmd.request_id)
            admissions.append(Admission(cmd.request_id, "InvalidRequest", f"{type(exc).__name__}: {exc}"))
        else:
            self.owner[cmd.request_id] = front
            admissions.append(Admission(cmd.request_id))
