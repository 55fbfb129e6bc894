"""The engine core's own process: a busy loop of apply commands → step → send outputs.

```
 front end i (server process, or API server i)     core process (this module)
 ─────────────────────────────────────────────     ──────────────────────────
 PUSH  ipc://…/input-i  ── AddRequest / Abort / Shutdown ──▶ PULL i  (drained between steps)
 PULL  ipc://…/output-i ◀── CoreBatch: admissions, outputs, stats ── PUSH i  (one per step)
 multiprocessing Pipe ◀── ("ready", ModelFacts) | ("error", message) ── once, at start-up
```

Messages are msgspec structs in msgpack: token ids and sampling parameters in, token ids out.
With ``--api-server-count N`` there are N front ends, each with its own pair of sockets: the
core remembers which front added each request (the socket its AddRequest came in on) and sends
that request's admission and outputs back on that front's output socket only; the stats snapshot
goes to every front, so each answers /load and /metrics with the same engine-wide figures. An
Abort is applied only for the front that owns the request (a request id refused as a duplicate
must not let its sender abort another front's request of that id).
ZMQ does its socket I/O on its own threads, so the loop never waits on a socket while it has
work; with none, it blocks on the input socket, waking every second to check that its parent
is alive (an orphaned core exits instead of holding memory forever).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import msgspec
import zmq

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.block_map import BlockMapFeed
from pagedserve.engine.core import EngineCore
from pagedserve.engine.core_launch import die_with_parent, unpin_helper_threads
# The messages, named here too (the front imports them from wire, without the engine core).
from pagedserve.engine.wire import (  # noqa: F401
    Abort, AddRequest, Admission, Command, CoreBatch, Shutdown, WatchBlocks)

logger = logging.getLogger(__name__)

# While busy, send the stats snapshot at most this often (and whenever a request finishes).
STATS_INTERVAL_S = 0.02
_IDLE_POLL_MS = 1000


def run_engine_core(config: EngineConfig, addrs: list[tuple[str, str]], ready: Any, log_level: str,
                    cpus: set[int] | None = None) -> None:
    """The child process's entry point (spawned): build the core, report ready, serve until told to stop.

    ``addrs``: one (input, output) address pair per front end; ``cpus``: the CPUs the process may
    use, which its helper threads get back when the step threads are pinned (``bind_step_threads``)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    if config.engine_core_nice > 0:
        _log_priority()
    die_with_parent()
    # Ctrl-C in a terminal reaches the whole process group; the server stops the core itself (a
    # Shutdown command, or a signal after its front ends drained), so the core must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parent = os.getppid()
    try:
        core = EngineCore(config)
    except Exception as exc:  # a bad model path, a budget that holds no block, ...: one line for the user
        ready.send(("error", errors.startup_error_line(exc)))
        raise SystemExit(2) from None
    ctx = zmq.Context(io_threads=1)
    commands, results = [], []
    for input_addr, output_addr in addrs:
        pull = ctx.socket(zmq.PULL)
        pull.connect(input_addr)
        commands.append(pull)
        push = ctx.socket(zmq.PUSH)
        # A send blocks only while the server's queue is full; wake up every second to check that it
        # still exists instead of blocking forever on a peer that is gone.
        push.setsockopt(zmq.SNDTIMEO, 1000)
        push.connect(output_addr)
        results.append(push)
    unpin_helper_threads(cpus)  # ZMQ starts its I/O thread with the first socket: it exists now
    ready.send(("ready", core.facts()))
    ready.close()
    try:
        _serve(core, commands, results, parent)
    finally:
        core.close()
        for sock in commands:
            sock.close(linger=0)
        for sock in results:
            sock.close(linger=1000)
        ctx.term()


def _log_priority() -> None:
    """Say the priority the core runs at (set by core_launch before torch started its threads)."""
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        batch = os.sched_getscheduler(0) == os.SCHED_BATCH
    except (AttributeError, OSError):
        return
    logger.info("engine core at niceness %d%s: the HTTP front ends preempt its step loop on shared cores "
                "(--engine-core-nice)", nice, " under SCHED_BATCH" if batch else "")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)  # through the finally above: the KV event publisher flushes, sockets close


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


def _serve(core: EngineCore, commands: list[zmq.Socket], results: list[zmq.Socket], parent: int) -> None:
    try:
        _loop(core, commands, results, parent)
    except _ParentGone:
        logger.warning("the server process is gone: engine core exiting")


class _Fronts:
    """Per front end: who owns which request, who watches the block map, what goes out this pass."""

    def __init__(self, count: int):
        self.owner: dict[str, int] = {}  # request id -> the front that added it
        self.watching: set[int] = set()
        self.batches = [CoreBatch() for _ in range(count)]

    def reset(self) -> None:
        self.batches = [CoreBatch() for _ in self.batches]


def _loop(core: EngineCore, commands: list[zmq.Socket], results: list[zmq.Socket], parent: int) -> None:
    decoder = msgspec.msgpack.Decoder(list[Command])
    encoder = msgspec.msgpack.Encoder()
    last_stats = last_parent_check = 0.0
    blocks = BlockMapFeed()
    fronts = _Fronts(len(commands))
    poller = zmq.Poller()
    for sock in commands:
        poller.register(sock, zmq.POLLIN)
    while True:
        fronts.reset()
        if not core.has_unfinished_requests():
            if not poller.poll(_IDLE_POLL_MS):
                if os.getppid() != parent:
                    raise _ParentGone()
                continue
        for front, sock in enumerate(commands):
            received: list[bytes] = []
            while sock.poll(0):
                received.append(sock.recv(copy=False).bytes)
            for frame in received:
                for cmd in decoder.decode(frame):
                    if isinstance(cmd, Shutdown):
                        final = encoder.encode(CoreBatch(stats=core.stats()))
                        for out in results:
                            _send(out, final, parent)
                        return
                    if isinstance(cmd, WatchBlocks):
                        (fronts.watching.add if cmd.on else fronts.watching.discard)(front)
                        if cmd.on or not fronts.watching:
                            blocks.watch(bool(fronts.watching))  # a new viewer: a snapshot is owed
                        continue
                    _apply(core, cmd, front, fronts)
        outputs = core.step() if core.has_unfinished_requests() else []
        for out in outputs:
            front = fronts.owner.pop(out.request_id, None) if out.finished else fronts.owner.get(out.request_id)
            if front is not None:
                fronts.batches[front].outputs.append(out)
        now = time.monotonic()
        if now - last_parent_check >= 1.0:  # busy for long: still someone to serve?
            if os.getppid() != parent:
                raise _ParentGone()
            last_parent_check = now
        idle = not core.has_unfinished_requests()
        if idle or any(o.finished for o in outputs) or now - last_stats >= STATS_INTERVAL_S:
            stats, last_stats = core.stats(), now
            for batch in fronts.batches:
                batch.stats = stats
        block_map = blocks.maybe_build(core, now, idle)
        if block_map is not None:
            for front in fronts.watching:
                fronts.batches[front].block_map = block_map
        for front, batch in enumerate(fronts.batches):
            if batch.admissions or batch.aborted or batch.outputs or batch.stats is not None \
                    or batch.block_map is not None:
                _send(results[front], encoder.encode(batch), parent)


def _apply(core: EngineCore, cmd: AddRequest | Abort, front: int, fronts: _Fronts) -> None:
    batch = fronts.batches[front]
    if isinstance(cmd, Abort):
        if fronts.owner.get(cmd.request_id) != front:
            return  # not this front's request (already ended, or another front's of the same id)
        if core.abort(cmd.request_id, cmd.index) and cmd.index is None:
            batch.aborted.append(cmd.request_id)
        if not core.has_request(cmd.request_id):
            del fronts.owner[cmd.request_id]
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
        fronts.owner[cmd.request_id] = front
        batch.admissions.append(Admission(cmd.request_id))
