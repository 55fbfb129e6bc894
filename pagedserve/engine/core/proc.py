"""The engine core's own process: the core loop (engine/core/loop.py) over ZMQ sockets.

```
 front end i (server process, or API server i)     core process (this module)
 ─────────────────────────────────────────────     ──────────────────────────
 PUSH  ipc://…/input-i  ── AddRequest / Abort / Shutdown ──▶ PULL i  (drained between steps)
 PULL  ipc://…/output-i ◀── CoreBatch: admissions, outputs, stats ── PUSH i  (one per step)
 multiprocessing Pipe ◀── ("ready", ModelFacts) | ("error", message) ── once, at start-up
```

Messages are msgspec structs in msgpack (engine/wire.py): token ids and sampling parameters in,
token ids out. With ``--api-server-count N`` there are N front ends, each with its own pair of
sockets; :class:`~pagedserve.engine.core.loop.CoreLoop` routes each request's answers to its front.
ZMQ does its socket I/O on its own threads, so the loop never waits on a socket while it has
work; with none, it blocks on the input socket, waking every second to check that its parent
is alive (an orphaned core exits instead of holding memory forever).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.process_placement import die_with_parent, unpin_helper_threads
from pagedserve.engine.core.loop import CoreLoop
from pagedserve.engine.wire import Command, CoreBatch

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000


def run_engine_core(config: EngineConfig, addrs: list[tuple[str, str]], ready: Any, log_level: str,
                    cpus: set[int] | None = None,
                    core_factory: Callable[[EngineConfig], EngineCore] | None = None) -> None:
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
        core = (core_factory or EngineCore)(config)
    except Exception as exc:  # a bad model path, a budget that holds no block, ...: one line for the user
        ready.send(("error", errors.startup_error_line(exc)))
        raise SystemExit(2) from None
    # The model, its tables and the tokenizer live until exit: moved out of the cyclic GC's reach
    # (as vLLM's core does), the collections a decode step triggers walk only per-step objects (a
    # profile of the default model's decode showed 2.5 % of its samples in gc_collect_main & co.).
    gc.collect()
    gc.freeze()
    ctx = zmq.Context(io_threads=1)
    # A send blocks only while the server's queue is full; wake up every second to check that it
    # still exists instead of blocking forever on a peer that is gone (the command sockets never send).
    ctx.setsockopt(zmq.SNDTIMEO, 1000)
    commands, results = [ctx.socket(zmq.PULL) for _ in addrs], [ctx.socket(zmq.PUSH) for _ in addrs]
    for (input_addr, output_addr), pull, push in zip(addrs, commands, results):
        pull.connect(input_addr)
        push.connect(output_addr)
    unpin_helper_threads(cpus)  # ZMQ starts its I/O thread with the first socket: it exists now
    ready.send(("ready", core.facts()))
    ready.close()
    try:
        CoreLoop(core, ZmqTransport(commands, results, parent)).run()
    except _ParentGone:
        logger.warning("the server process is gone: engine core exiting")
    finally:
        core.close()
        ctx.destroy(linger=1000)  # every socket: the last batches still go out (the command sockets hold none)


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
    """The server process that started the core is gone: nobody is left to serve."""


class ZmqTransport:
    """The core process's side of the sockets: one PULL (commands) and one PUSH (batches) per front."""

    def __init__(self, commands: list[zmq.Socket], results: list[zmq.Socket], parent: int):
        self.num_fronts = len(commands)
        self.commands, self.results, self.parent = commands, results, parent
        self.decoder = msgspec.msgpack.Decoder(list[Command])
        self.encoder = msgspec.msgpack.Encoder()
        self.poller = zmq.Poller()
        for sock in commands:
            self.poller.register(sock, zmq.POLLIN)
        self._last_parent_check = 0.0

    def wait(self) -> None:
        while not self.poller.poll(_IDLE_POLL_MS):
            self._check_parent()  # idle for a second: is there still someone to serve?

    def receive(self) -> list[tuple[int, Command]]:
        received: list[tuple[int, Command]] = []
        for front, sock in enumerate(self.commands):
            while sock.poll(0):
                received += [(front, cmd) for cmd in self.decoder.decode(sock.recv(copy=False).bytes)]
        return received

    def send(self, front: int, batch: CoreBatch) -> None:
        frame = self.encoder.encode(batch)
        while True:
            try:
                self.results[front].send(frame, copy=False)
                return
            except zmq.Again:  # the front's queue is full for a second: is it still there?
                self._check_parent()

    def check(self, now: float) -> None:
        if now - self._last_parent_check >= 1.0:  # busy for long: still someone to serve?
            self._check_parent()
            self._last_parent_check = now

    def _check_parent(self) -> None:
        if os.getppid() != self.parent:
            raise _ParentGone()
