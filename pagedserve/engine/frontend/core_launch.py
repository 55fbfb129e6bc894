"""Spawning the engine core's process without importing the engine: the server starts the core
first and loads its own side (torch, FastAPI, the tokenizers) while the core loads the model.

Both start-ups cost seconds (each process imports torch, the front its web and tokenizer
libraries); run one after the other they add up, run side by side on two cores they overlap.
This module therefore imports nothing heavy: the child imports
:mod:`pagedserve.engine.core.proc` itself, in :func:`_run_core`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import select
import tempfile
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedserve.engine.process_placement import bind_step_threads, yield_cpu_to_front_ends

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.core.engine_core import EngineCore
    from pagedserve.engine.wire import ModelFacts


class EngineStartupError(RuntimeError):
    """The core process could not build the engine (its message says why, in one line)."""


@dataclass
class CoreProcess:
    """A started core process (a child of this one) and the addresses its sockets connect to:
    one (input, output) pair per front end, the first for an ``MPEngineClient`` in this process."""

    process: BaseProcess
    addrs: list[tuple[str, str]]
    facts: ModelFacts
    socket_dir: tempfile.TemporaryDirectory
    owned = True  # the client that attaches stops it (a Shutdown command, then kill)

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_code(self) -> int | None:
        self.process.join(1)
        return self.process.exitcode

    def link(self, front: int) -> CoreLink:
        """What front end ``front`` (in another process) needs to attach to this core."""
        return CoreLink([self.addrs[front]], self.facts, self.process.pid or 0)

    def kill(self) -> None:
        self.process.kill()  # a no-op once it has exited
        self.process.join(5)

    def cleanup(self) -> None:
        self.socket_dir.cleanup()


@dataclass
class CoreLink:
    """A core started by another process, as one of its front ends sees it (picklable: it is
    handed to the front's process). :meth:`open` must be called in the front's own process."""

    addrs: list[tuple[str, str]]  # its front's (input, output) pair, alone
    facts: ModelFacts
    pid: int
    owned = False  # the process that started the core stops it
    _pidfd: int | None = field(default=None, repr=False)

    def open(self) -> None:
        # A pidfd turns readable when the process exits, whoever its parent is (Linux 5.3+).
        self._pidfd = os.pidfd_open(self.pid)

    @property
    def sentinel(self) -> int:
        assert self._pidfd is not None, "open() the link first"
        return self._pidfd

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def exit_code(self) -> int | None:
        return None  # not our child: its status goes to the process that started it

    def kill(self) -> None:
        pass  # not ours to stop

    def cleanup(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None



@dataclass
class CoreLaunch:
    """A core process that was spawned and may still be loading its model."""

    process: BaseProcess
    addrs: list[tuple[str, str]]
    socket_dir: tempfile.TemporaryDirectory
    receiver: multiprocessing.connection.Connection

    def wait_ready(self) -> CoreProcess:
        """Block until the core has loaded the model; raise :class:`EngineStartupError` with its
        one-line reason if it could not (or died without saying)."""
        process, receiver = self.process, self.receiver
        try:  # the first message, or the process's death without one
            multiprocessing.connection.wait([receiver, process.sentinel])
            kind, payload = receiver.recv() if receiver.poll() else ("error", None)
        except EOFError:
            kind, payload = "error", None
        finally:
            receiver.close()
        if kind != "ready":
            process.join(5)
            self.socket_dir.cleanup()
            raise EngineStartupError(payload or f"the engine core process exited with code {process.exitcode} "
                                                "while loading the model (see its log above)")
        return CoreProcess(process, self.addrs, payload, self.socket_dir)

    def kill(self) -> None:
        """Give up on a launch (the server failed to start its own side)."""
        self.process.kill()
        self.process.join(5)
        self.receiver.close()
        self.socket_dir.cleanup()


def spawn_core_process(config: EngineConfig, log_level: str = "info", num_fronts: int = 1,
                       core_factory: Callable[[EngineConfig], EngineCore] | None = None) -> CoreLaunch:
    """Spawn the core; it starts loading at once. :meth:`CoreLaunch.wait_ready` waits for it.
    ``num_fronts``: how many front ends will attach (one socket pair each). ``core_factory``
    (picklable; called in the child) builds the core in place of ``EngineCore(config)``: the
    fault tests' seam (tests/helpers/faults.py), never set by the server itself."""
    socket_dir = tempfile.TemporaryDirectory(prefix="pagedserve-")
    addrs = [(f"ipc://{socket_dir.name}/input-{i}", f"ipc://{socket_dir.name}/output-{i}") for i in range(num_fronts)]
    return launch(config, log_level, addrs, socket_dir, core_factory)


def launch(config: EngineConfig, log_level: str, addrs: list[tuple[str, str]],
            socket_dir: tempfile.TemporaryDirectory,
            core_factory: Callable[[EngineConfig], EngineCore] | None = None) -> CoreLaunch:
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads and locks
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run_core, name="pagedserve-core", daemon=True,
                          args=(config, addrs, sender, log_level, core_factory))
    process.start()
    sender.close()
    return CoreLaunch(process, addrs, socket_dir, receiver)


def _run_core(config: EngineConfig, addrs: list[tuple[str, str]], ready: Any, log_level: str,
              core_factory: Callable[[EngineConfig], EngineCore] | None = None) -> None:
    """The child's entry point: only here is the engine imported."""
    # Before torch starts its thread pool, so that its threads inherit the priority and the places.
    yield_cpu_to_front_ends(config.engine_core_nice)
    # Before any pinning: the core's other threads get all of these back (unpin_helper_threads).
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if config.bind_step_threads:
        bind_step_threads(config.num_threads)
    from pagedserve.engine.core.proc import run_engine_core

    run_engine_core(config, addrs, ready, log_level, cpus, core_factory)
