"""Spawning the engine core's process without importing the engine: the server starts the core
first and loads its own side (torch, FastAPI, the tokenizers) while the core loads the model.

Both start-ups cost seconds (each process imports torch, the front its web and tokenizer
libraries); run one after the other they add up, run side by side on two cores they overlap.
This module therefore imports nothing heavy: the child imports
:mod:`pagedserve.engine.core_proc` itself, in :func:`_run_core`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.core import EngineCore
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
    def input_addr(self) -> str:
        return self.addrs[0][0]

    @property
    def output_addr(self) -> str:
        return self.addrs[0][1]

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
        input_addr, output_addr = self.addrs[front]
        return CoreLink(input_addr, output_addr, self.facts, self.process.pid or 0)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def cleanup(self) -> None:
        self.socket_dir.cleanup()


@dataclass
class CoreLink:
    """A core started by another process, as one of its front ends sees it (picklable: it is
    handed to the front's process). :meth:`open` must be called in the front's own process."""

    input_addr: str
    output_addr: str
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
        try:
            while True:  # wait for the first message, or for the process to die without one
                ready = multiprocessing.connection.wait([receiver, process.sentinel])
                if receiver in ready:
                    try:
                        kind, payload = receiver.recv()
                    except EOFError:
                        kind, payload = "error", None
                    break
                if process.sentinel in ready and not receiver.poll():
                    kind, payload = "error", None
                    break
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
        if self.process.is_alive():
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
    return _launch(config, log_level, addrs, socket_dir, core_factory)


def respawn_core_process(dead: CoreProcess, config: EngineConfig, log_level: str = "info") -> CoreLaunch:
    """Spawn a core in place of ``dead`` (``serve --restart-engine-core``): the same config and the
    same socket addresses, which the front end still has bound, so its sockets simply take the new
    core's connections. The new :class:`CoreProcess` shares ``dead``'s socket directory."""
    dead.kill()  # reaped (it is dead already, or is made so: never two cores on one socket pair)
    return _launch(config, log_level, dead.addrs, dead.socket_dir)


def die_with_parent() -> None:
    """On Linux, have the kernel kill this process when the server process dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the core's parent checks still end an orphan within a second or two


def _launch(config: EngineConfig, log_level: str, addrs: list[tuple[str, str]],
            socket_dir: tempfile.TemporaryDirectory,
            core_factory: Callable[[EngineConfig], EngineCore] | None = None) -> CoreLaunch:
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads and locks
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run_core, name="pagedserve-core", daemon=True,
                          args=(config, addrs, sender, log_level, core_factory))
    process.start()
    sender.close()
    return CoreLaunch(process, addrs, socket_dir, receiver)


def yield_cpu_to_front_ends(nice: int) -> None:
    """Run this thread, and every thread it starts from now on, under SCHED_BATCH at niceness
    ``nice`` (no-ops where the OS has neither; both need no privilege).

    On cores the step loop shares with the HTTP processes, each token they stream is a short burst
    of work after a wake-up; at equal priority the scheduler may let the step loop (and torch's
    worker threads, which spin between parallel regions) finish its slice first, so every hop of a
    request queues behind model steps. Lower priority and no wake-up preemption of its own make the
    loop the one that waits, while it still gets every cycle the fronts leave idle."""
    if nice <= 0:
        return
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    with contextlib.suppress(AttributeError, OSError):
        os.nice(nice)


# Any of these set: the user (or vLLM-style tooling) placed the threads already; leave them be.
OPENMP_AFFINITY_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def usable_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity mask: taskset, a cgroup's
    cpuset); each CPU counts as its own core where the topology cannot be read; 1 where the OS has
    no affinity masks."""
    if not hasattr(os, "sched_getaffinity"):
        return 1
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
                cores.add((package.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores)


def bind_step_threads(num_threads: int | None) -> bool:
    """Pin the step's OpenMP threads one per core, when it runs one thread per usable core and the
    environment places none itself; True if pinned. Sets the environment torch's OpenMP runtime
    reads when it starts, so it must run before torch is imported.

    Why: between steps the worker threads spin, then sleep. A worker woken for the first step after
    an idle moment may be queued on its master's core, where the master spins at the region's
    barrier waiting for it: the step, and an idle server's first token, comes a time slice late
    (vLLM's CPU backend pins its threads too). With fewer threads than cores nothing is pinned, so
    that servers sharing a machine are not stacked onto the same cores."""
    if any(name in os.environ for name in OPENMP_AFFINITY_VARIABLES):
        return False
    cores = usable_cores()
    threads = num_threads
    if threads is None:
        threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else cores
    if threads != cores or cores < 2:
        return False
    os.environ["OMP_NUM_THREADS"] = str(threads)  # what torch would pick; made explicit to match the places
    os.environ["OMP_PROC_BIND"] = "close"
    os.environ["OMP_PLACES"] = "cores"  # libgomp limits the places to this process's affinity mask
    return True


def unpin_helper_threads(cpus: set[int] | None) -> int:
    """Give ``cpus`` back to the threads that inherited the step loop's pin; how many.

    A new thread inherits its creator's CPUs, so the threads the core's main thread started after
    OpenMP pinned it (ZMQ's I/O threads, the KV event publisher's) would share its one core and, under
    SCHED_BATCH, wait out its time slice to move a step's outputs. Threads started later still
    inherit the pin (the grammar compiler's pool, on first use). OpenMP's workers keep their own
    places, which are never the main thread's."""
    if not cpus or not hasattr(os, "sched_getaffinity"):
        return 0
    pinned = os.sched_getaffinity(0)
    if pinned == cpus:
        return 0
    main, moved = threading.get_native_id(), 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if tid != main and os.sched_getaffinity(tid) == pinned:
                os.sched_setaffinity(tid, cpus)
                moved += 1
    return moved


def _run_core(config: EngineConfig, addrs: list[tuple[str, str]], ready: Any, log_level: str,
              core_factory: Callable[[EngineConfig], EngineCore] | None = None) -> None:
    """The child's entry point: only here is the engine imported."""
    # Before torch starts its thread pool, so that its threads inherit the priority and the places.
    yield_cpu_to_front_ends(config.engine_core_nice)
    # Before any pinning: the core's other threads get all of these back (unpin_helper_threads).
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if config.bind_step_threads:
        bind_step_threads(config.num_threads)
    from pagedserve.engine.core_proc import run_engine_core

    run_engine_core(config, addrs, ready, log_level, cpus, core_factory)
