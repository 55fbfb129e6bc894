"""Where the engine core process runs: its priority, its step threads' cores, its parent's life.

Shared by the launcher (engine/frontend/core_launch.py, which sets what must be set before torch
starts in the child) and the core process itself (engine/core/proc.py); it imports neither side,
nor torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading


def die_with_parent() -> None:
    """On Linux, have the kernel kill this process when the server process dies (even by SIGKILL)."""
    # Not Linux: the core's parent checks still end an orphan within a second or two.
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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
    cores, env = usable_cores(), os.environ.get("OMP_NUM_THREADS", "")
    threads = num_threads if num_threads is not None else int(env) if env.isdigit() else cores
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
