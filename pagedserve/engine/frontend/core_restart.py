"""``serve --restart-engine-core``: what a front end needs to replace an engine core that died.

The front end (:class:`~pagedserve.engine.frontend.mp_client.MPEngineClient`) fails the dead core's
requests as always, then asks this policy for a new core: the same resolved config, spawned on the
same socket addresses. A :class:`RestartBudget` bounds how often: a core that keeps dying (memory
too tight, a broken device, a request that crashes it every time it is retried) ends the server
after K restarts within a window instead of looping, so an outside supervisor or a person sees it.
This module imports nothing heavy (the server builds it before the engine is imported).
"""

from __future__ import annotations

import collections
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine.frontend.core_launch import CoreLaunch, CoreProcess, launch

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig


class RestartBudget:
    """At most ``max_restarts`` restarts within any ``window_s`` seconds (a sliding window)."""

    def __init__(self, max_restarts: int = 3, window_s: float = 60.0):
        if max_restarts < 1 or not window_s > 0:
            raise ValueError(f"a restart budget needs max_restarts >= 1 and window_s > 0, got {max_restarts}, "
                             f"{window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()

    def take(self, now: float | None = None) -> bool:
        """Spend one restart if the window has one left; False (nothing spent) if not."""
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


@dataclass
class CoreRestarter:
    """The config a dead core is restarted with, and the budget that bounds restarts."""

    config: EngineConfig
    log_level: str = "info"
    budget: RestartBudget = field(default_factory=RestartBudget)

    def respawn(self, dead: CoreProcess) -> CoreLaunch:
        """Start loading a new core in place of ``dead`` (the caller spent the budget): the same config
        and the same socket addresses, which the front end still has bound, so its sockets simply take
        the new core's connections. The new :class:`CoreProcess` shares ``dead``'s socket directory."""
        dead.kill()  # reaped (it is dead already, or is made so: never two cores on one socket pair)
        return launch(self.config, self.log_level, dead.addrs, dead.socket_dir)


def describe_exit(code: int | None) -> str:
    """'exit code 1' or 'killed by SIGKILL' for a process's exit status (negative: a signal)."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
