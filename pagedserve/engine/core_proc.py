"""The engine core's own process: a busy loop of apply commands → step → send outputs.

```
 front end (server process)                      core process (this module)
 ──────────────────────────                      ──────────────────────────
 PUSH  ipc://…/input  ── AddRequest / Abort / Shutdown ──▶ PULL   (drained between steps)
 PULL  ipc://…/output ◀── CoreBatch: admissions, outputs, stats ── PUSH  (one per step)
 multiprocessing Pipe ◀── ("ready", ModelFacts) | ("error", message) ── once, at start-up
```

Messages are msgspec structs in msgpack: token ids and sampling parameters in, token ids out.
ZMQ does its socket I/O on its own threads, so the loop never waits on a socket while it has
work; with none, it blocks on the input socket, waking every second to check that its parent
is alive (an orphaned core exits instead of holding memory forever).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec
import zmq

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.block_map import BlockMap, BlockMapFeed
from pagedserve.engine.core import CoreOutput, EngineCore
from pagedserve.engine.outputs import EngineStats
from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# While busy, send the stats snapshot at most this often (and whenever a request finishes).
STATS_INTERVAL_S = 0.02
_IDLE_POLL_MS = 1000


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
    pass


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


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, ready: Any, log_level: str) -> None:
    """The child process's entry point (spawned): build the core, report ready, serve until told to stop."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    _die_with_parent()
    parent = os.getppid()
    try:
        core = EngineCore(config)
    except Exception as exc:  # a bad model path, a budget that holds no block, ...: one line for the user
        ready.send(("error", errors.startup_error_line(exc)))
        raise SystemExit(2) from None
    ctx = zmq.Context(io_threads=1)
    commands = ctx.socket(zmq.PULL)
    commands.connect(input_addr)
    results = ctx.socket(zmq.PUSH)
    # A send blocks only while the server's queue is full; wake up every second to check that it
    # still exists instead of blocking forever on a peer that is gone.
    results.setsockopt(zmq.SNDTIMEO, 1000)
    results.connect(output_addr)
    ready.send(("ready", core.facts()))
    ready.close()
    try:
        _serve(core, commands, results, parent)
    finally:
        core.close()
        commands.close(linger=0)
        results.close(linger=1000)
        ctx.term()


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this process when the server process dies (even by SIGKILL)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent checks below still end an orphan within a second or two


class _ParentGone(Exception):
    pass


def _send(results: zmq.Socket, frame: bytes, parent: int) -> None:
    while True:
        try:
            results.send(frame, copy=False)
            return
        except zmq.Again:
            if os.getppid() != parent:
                raise _ParentGone() from None


def _serve(core: EngineCore, commands: zmq.Socket, results: zmq.Socket, parent: int) -> None:
    try:
        _loop(core, commands, results, parent)
    except _ParentGone:
        logger.warning("the server process is gone: engine core exiting")


def _loop(core: EngineCore, commands: zmq.Socket, results: zmq.Socket, parent: int) -> None:
    decoder = msgspec.msgpack.Decoder(list[Command])
    encoder = msgspec.msgpack.Encoder()
    last_stats = last_parent_check = 0.0
    blocks = BlockMapFeed()
    while True:
        batch = CoreBatch()
        received: list[bytes] = []
        if not core.has_unfinished_requests():
            if not commands.poll(_IDLE_POLL_MS):
                if os.getppid() != parent:
                    raise _ParentGone()
                continue
        while commands.poll(0):
            received.append(commands.recv(copy=False).bytes)
        for frame in received:
            for cmd in decoder.decode(frame):
                if isinstance(cmd, Shutdown):
                    _send(results, encoder.encode(CoreBatch(stats=core.stats())), parent)
                    return
                if isinstance(cmd, WatchBlocks):
                    blocks.watch(cmd.on)
                    continue
                _apply(core, cmd, batch)
        if core.has_unfinished_requests():
            batch.outputs = core.step()
        now = time.monotonic()
        if now - last_parent_check >= 1.0:  # busy for long: still someone to serve?
            if os.getppid() != parent:
                raise _ParentGone()
            last_parent_check = now
        idle = not core.has_unfinished_requests()
        if idle or any(o.finished for o in batch.outputs) or now - last_stats >= STATS_INTERVAL_S:
            batch.stats, last_stats = core.stats(), now
        batch.block_map = blocks.maybe_build(core, now, idle)
        if batch.admissions or batch.aborted or batch.outputs or batch.stats is not None \
                or batch.block_map is not None:
            _send(results, encoder.encode(batch), parent)


def _apply(core: EngineCore, cmd: AddRequest | Abort, batch: CoreBatch) -> None:
    if isinstance(cmd, Abort):
        if core.abort(cmd.request_id, cmd.index) and cmd.index is None:
            batch.aborted.append(cmd.request_id)
        return
    try:
        core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.priority, cmd.cache_salt,
                         cmd.arrival_time)
    except errors.PagedServeError as exc:
        batch.admissions.append(Admission(cmd.request_id, type(exc).__name__, exc.message, exc.param,
                                          getattr(exc, "retry_after_s", None)))
    except Exception as exc:  # a bug, not the client's fault: refuse this one request, keep serving
        logger.exception("adding request %s failed", cmd.request_id)
        batch.admissions.append(Admission(cmd.request_id, "InvalidRequest", f"{type(exc).__name__}: {exc}"))
    else:
        batch.admissions.append(Admission(cmd.request_id))
