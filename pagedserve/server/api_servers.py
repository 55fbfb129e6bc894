"""``serve --api-server-count N``: one engine core process, N HTTP front processes on one port.

```
 supervisor (the `pagedserve serve` process)
 │  binds the listening socket once, starts the core, then the fronts; watches every child
 ├── engine core process        EngineCore; socket pair i <-> front i   (engine/core/proc.py)
 ├── API server 0               uvicorn on the inherited socket: HTTP, tokenizer, chat template,
 │     MPEngineClient           detokenizer, SSE for the requests it accepted   (CoreLink 0)
 ├── ...
 └── API server N-1
```

The socket is bound here, before the model loads (a taken port is a one-line error at once), and
every front inherits it and accepts from its one queue: a front that is busy simply accepts less,
and connections waiting there survive a front that dies. (SO_REUSEPORT would give each front a
queue of its own that the kernel fills by hash, blind to how busy the front is, and would let any
other process of the same user bind the port alongside.) Fronts wait at a start line until all
of them have loaded, so the first requests already spread over all of them.

Faults: a front learns of the core's death from a pidfd and ends its streams with an error event
at once, then exits with 1; the supervisor, seeing the core gone, waits for the fronts and exits
with 1. A front that dies makes the supervisor stop the others and the core and exit with 1 (a
process supervisor restarts the server). Every child asks the kernel to kill it if the supervisor
dies (PR_SET_PDEATHSIG), so none is left orphaned even if the supervisor is SIGKILLed. SIGINT or
SIGTERM: the fronts drain (``--shutdown-timeout``), then the core stops, and the exit status is 0.

With ``--restart-engine-core`` the supervisor replaces a core that dies, within the restart budget:
each front fails its open requests and answers 503 as before but stays up; the supervisor spawns a
core with the same config on the same socket addresses (the fronts' bound sockets take its
connections), waits until it has loaded (still watching the fronts and its signals), and sends
each front the new core's :class:`CoreLink` down its start line, kept open for this. Past the
budget, or if the new core fails to load, it stops the fronts and exits with 1 as without the flag.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine import CoreLink, CoreProcess, CoreRestarter
    from pagedserve.server.config import ServerConfig

logger = logging.getLogger("pagedserve.server")

MAX_API_SERVERS = 16  # a front costs a process, a tokenizer and a socket pair: beyond this, use replicas
_START_TIMEOUT_S = 300.0  # for every front to load its tokenizers and reach the start line
_POLL_S = 0.2  # how often the supervisor looks at its flags between child events


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """The server's TCP socket, bound (the fronts' event loops start listening on it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port") from None
    return sock


# ---- one front (its own process) --------------------------------------------------------------


def run_api_server(index: int, link: CoreLink, sock: socket.socket, config: ServerConfig, log_level: str,
                   start_line: multiprocessing.connection.Connection, core_restarts: bool = False) -> None:
    """A front process's entry point (spawned): serve HTTP on ``sock`` through the core at ``link``.
    ``core_restarts``: the supervisor replaces a dead core and sends its link down ``start_line``."""
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [api-server {index}]: %(message)s")
    from pagedserve.engine import factory
    from pagedserve.engine import die_with_parent

    die_with_parent()
    supervisor = multiprocessing.parent_process()
    if supervisor is not None and os.getppid() != supervisor.pid:
        raise SystemExit(1)  # the supervisor died before we asked to die with it
    # Out of the terminal's process group: Ctrl-C reaches the supervisor, which stops the fronts
    # with one SIGTERM each (a second signal from the terminal would make uvicorn skip its drain).
    os.setpgid(0, 0)
    import uvicorn

    from pagedserve.server.app import build_app
    from pagedserve.server.cli import serve_app
    from pagedserve.server.limits import uvicorn_limits

    async def wait_at_start_line() -> None:
        def ready_then_go() -> None:
            start_line.send("ready")
            try:
                go = start_line.recv()
            except EOFError:
                go = None
            if go != "go":
                raise RuntimeError("the supervisor called off the start")
        await asyncio.to_thread(ready_then_go)
        if core_restarts:
            asyncio.get_running_loop().add_reader(start_line.fileno(), new_core)

    def new_core() -> None:  # on the event loop: the supervisor started a core in place of a dead one
        try:
            kind, new_link = start_line.recv()
        except (EOFError, OSError):  # the supervisor closed the line: it is stopping us
            asyncio.get_running_loop().remove_reader(start_line.fileno())
            return
        if kind == "core":
            client.attach(new_link)

    client = factory.connect(link, log_requests=config.log_requests, restarted_by_supervisor=core_restarts)
    app = build_app(client, config, on_started=wait_at_start_line)
    uvicorn_config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=config.shutdown_timeout_s,
                                    access_log=False, **uvicorn_limits(config))
    engine_died = serve_app(app, client, uvicorn_config, sockets=[sock])
    if engine_died:
        logger.error("exiting with status 1: the engine core process died")
        raise SystemExit(1)


# ---- the supervisor ---------------------------------------------------------------------------


def run_api_servers(count: int, engine_config: EngineConfig, config: ServerConfig, log_level: str,
                    sock: socket.socket, restarter: CoreRestarter | None = None) -> int:
    """Start the core and ``count`` fronts sharing ``sock``; supervise them; the exit status.
    ``restarter``: replace a core that dies (``--restart-engine-core``)."""
    from pagedserve.engine import EngineStartupError, spawn_core_process
    from pagedserve.server.cli import _log_startup

    stop = _StopFlag()
    metrics_dir = tempfile.TemporaryDirectory(prefix="pagedserve-metrics-")
    # Read by prometheus-client in each front as it is imported (pagedserve.server.metrics).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
    core = None
    fronts: list[BaseProcess] = []
    lines: list[Any] = []
    try:
        try:
            core = spawn_core_process(engine_config, log_level, num_fronts=count).wait_ready()
        except EngineStartupError as exc:
            logger.error("cannot start: %s", exc)
            return 2
        logger.info("engine core running in process %d; starting %d API servers", core.process.pid, count)
        _log_startup(core.facts, config, True)
        ctx = multiprocessing.get_context("spawn")
        for i in range(count):
            ours, theirs = ctx.Pipe()
            front_config = _with_index(config, i)
            process = ctx.Process(target=run_api_server, name=f"pagedserve-api-server-{i}", daemon=True,
                                  args=(i, core.link(i), sock, front_config, log_level, theirs,
                                        restarter is not None))
            process.start()
            theirs.close()
            fronts.append(process)
            lines.append(ours)
        sock.close()  # the fronts hold it now
        status = _start_together(fronts, lines, core.process, stop, keep_lines=restarter is not None)
        if status is None:
            logger.info("%d API servers serving on http://%s:%d", count, config.host, config.port)
            status, core = _supervise(fronts, core, stop, lines, restarter)
        if not core.process.is_alive() and restarter is None:  # the fronts end their streams and exit
            deadline = time.monotonic() + config.shutdown_timeout_s + 5
            for front in fronts:
                front.join(max(0.0, deadline - time.monotonic()))
        _stop_fronts(fronts, config.shutdown_timeout_s + 10)
        return status
    finally:
        stop.restore()
        for line in lines:
            line.close()
        for front in fronts:  # (already stopped, unless something above raised)
            if front.is_alive():
                front.kill()
            front.join(5)
        if core is not None:
            _stop_core(core.process)
            core.cleanup()
        sock.close()
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        metrics_dir.cleanup()


def _with_index(config: ServerConfig, index: int) -> ServerConfig:
    import dataclasses

    return dataclasses.replace(config, api_server_index=index)


class _StopFlag:
    """SIGINT/SIGTERM in the supervisor: set a flag its loops read (the fronts get SIGTERM from it)."""

    def __init__(self) -> None:
        self.set = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: object) -> None:
        if not self.set:
            logger.info("%s: stopping the API servers, then the engine core", signal.Signals(signum).name)
        self.set = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _start_together(fronts: list[BaseProcess], lines: list[Any], core: BaseProcess, stop: _StopFlag,
                    keep_lines: bool = False) -> int | None:
    """Wait until every front is ready, then let them all start accepting; None, or an exit status
    (then the lines are closed unsent, and a front still waiting at its start line gives up).
    ``keep_lines``: after "go" the lines stay open (a restarted core's link goes down them)."""
    status = None
    try:
        status = _wait_ready(fronts, lines, core, stop)
        if status is None:
            for line in lines:
                line.send("go")
        return status
    finally:
        if status is not None or not keep_lines:
            for line in lines:
                line.close()


def _wait_ready(fronts: list[BaseProcess], lines: list[Any], core: BaseProcess, stop: _StopFlag) -> int | None:
    waiting = set(range(len(fronts)))
    deadline = time.monotonic() + _START_TIMEOUT_S
    while waiting:
        if stop.set:
            return 0
        if time.monotonic() > deadline:
            logger.error("cannot start: API servers %s not ready within %.0f s", sorted(waiting), _START_TIMEOUT_S)
            return 2
        events = multiprocessing.connection.wait([lines[i] for i in waiting] + [f.sentinel for f in fronts]
                                                 + [core.sentinel], timeout=_POLL_S)
        for i in list(waiting):
            if lines[i] in events and lines[i].poll():
                try:
                    lines[i].recv()
                except EOFError:
                    continue  # it died: its sentinel says so below
                waiting.discard(i)
        if core.sentinel in events:
            logger.error("cannot start: the engine core process died (exit code %s)", core.exitcode)
            return 1
        for i, front in enumerate(fronts):
            if front.sentinel in events and not front.is_alive():
                logger.error("cannot start: API server %d exited with code %s while starting (see its log above)",
                             i, front.exitcode)
                return 2
    return None


def _supervise(fronts: list[BaseProcess], core: CoreProcess, stop: _StopFlag, lines: list[Any],
               restarter: CoreRestarter | None) -> tuple[int, CoreProcess]:
    """Until a signal (0) or a child's death (1), replacing a dead core while ``restarter``'s
    budget allows; the status and the core last started."""
    from pagedserve.engine import describe_exit

    while not stop.set:
        multiprocessing.connection.wait([f.sentinel for f in fronts] + [core.sentinel], timeout=_POLL_S)
        if not core.is_alive():
            how = describe_exit(core.process.exitcode)
            if restarter is None:
                # Each front saw it too (its pidfd), ended its streams with an error and is exiting.
                logger.error("the engine core process died (%s): the API servers end their requests "
                             "and the server exits with status 1 (restart it)", how)
                return 1, core
            budget = restarter.budget
            if not budget.take():
                logger.error("the engine core process died (%s) and the %d restarts allowed per %.0f s are spent "
                             "(--engine-core-max-restarts): giving up, exiting with status 1", how,
                             budget.max_restarts, budget.window_s)
                return 1, core
            logger.error("the engine core process (pid %s) died (%s): the API servers fail its requests, starting "
                         "a new core (restarts allowed: %d per %.0f s)", core.process.pid, how,
                         budget.max_restarts, budget.window_s)
            started = time.monotonic()
            new_core, status = _respawn(core, restarter, fronts, stop)
            if new_core is None:
                return status, core
            core = new_core
            for i, line in enumerate(lines):
                try:
                    line.send(("core", core.link(i)))
                except OSError:  # that front just died: the check below ends the server
                    pass
            logger.warning("engine core restarted in process %d after %.1f s", core.process.pid,
                           time.monotonic() - started)
            continue
        for i, front in enumerate(fronts):
            if not front.is_alive():
                logger.error("API server %d died (exit code %s): stopping the others and the engine core; "
                             "exiting with status 1 (restart the server)", i, front.exitcode)
                return 1, core
    return 0, core


def _respawn(dead: CoreProcess, restarter: CoreRestarter, fronts: list[BaseProcess],
             stop: _StopFlag) -> tuple[CoreProcess | None, int]:
    """A core in place of ``dead``, loaded; or None and the exit status (a signal: 0; a front's
    death or a core that fails to load: 1). Watches the fronts and the signals while it loads."""
    from pagedserve.engine import EngineStartupError

    launch = restarter.respawn(dead)
    while True:
        events = multiprocessing.connection.wait([launch.receiver, launch.process.sentinel]
                                                 + [f.sentinel for f in fronts], timeout=_POLL_S)
        if launch.receiver in events or launch.process.sentinel in events:
            break
        if stop.set or not all(f.is_alive() for f in fronts):
            launch.kill()
            return None, 0 if stop.set else 1
    try:
        return launch.wait_ready(), 0
    except EngineStartupError as exc:
        logger.error("the new engine core failed to start (%s): giving up, exiting with status 1", exc)
        return None, 1


def _stop_fronts(fronts: list[BaseProcess], timeout_s: float) -> None:
    """SIGTERM each live front (each drains as one server does), then kill what is left after ``timeout_s``."""
    for front in fronts:
        if front.is_alive() and front.pid is not None:
            os.kill(front.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for front in fronts:
        front.join(max(0.0, deadline - time.monotonic()))
        if front.is_alive():
            logger.warning("API server %s did not stop within %.0f s: killing it", front.name, timeout_s)
            front.kill()
            front.join(5)


def _stop_core(core: BaseProcess) -> None:
    if core.is_alive():
        core.terminate()  # the core exits on SIGTERM through its cleanup (KV event publisher, sockets)
        core.join(10)
    if core.is_alive():
        core.kill()
        core.join(5)
