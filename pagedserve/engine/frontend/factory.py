"""The one way into the engine for whoever serves it: start a core, get an :class:`EngineClient`.

The server, its API-server supervisor and the Ray replica import this module, the interface
(:mod:`pagedserve.engine.frontend.client`) and the request/output types, and nothing else of the engine.

Nothing heavy is imported at module level: ``serve`` spawns the core process first and imports
its own side (FastAPI, the tokenizers) while the core loads torch and the model
(:mod:`pagedserve.engine.frontend.core_launch`, which imports neither torch nor the core).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.engine.frontend.core_launch import (CoreLaunch, CoreLink, CoreProcess, EngineStartupError,
                                                    spawn_core_process)
from pagedserve.engine.process_placement import die_with_parent
from pagedserve.engine.frontend.core_restart import CoreRestarter, RestartBudget, describe_exit

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.client import EngineClient
    from pagedserve.engine.core.engine_core import EngineCore
    from pagedserve.tokenizer import TokenizerPreload

# What builds the core in place of ``EngineCore(config)``: the fault tests' seam, never the server's.
CoreFactory = Callable[["EngineConfig"], "EngineCore"]

def core_restarter(config: EngineConfig, log_level: str, max_restarts: int, window_s: float) -> CoreRestarter:
    """What replaces a dead core (``--restart-engine-core``): at most ``max_restarts`` per ``window_s``."""
    return CoreRestarter(config, log_level, RestartBudget(max_restarts, window_s))


def connect(core: CoreProcess | CoreLink, *, log_requests: bool = False, restarter: CoreRestarter | None = None,
            restarted_by_supervisor: bool = False, preload: TokenizerPreload | None = None) -> EngineClient:
    """A client over a core process: the one this process started (``CoreProcess``, which it then
    owns and stops), or one another process started (``CoreLink``: a front of several)."""
    from pagedserve.engine.frontend.mp_client import MPEngineClient

    return MPEngineClient(core, log_requests=log_requests, restarter=restarter,
                          restarted_by_supervisor=restarted_by_supervisor, preload=preload)


def in_process(config: EngineConfig, log_requests: bool = False,
               core_factory: CoreFactory | None = None) -> EngineClient:
    """A client whose core loop runs on a thread of this process (loads the model now).
    ``core_factory``: as for :func:`spawn_core_process` (the fault tests' seam)."""
    from pagedserve.engine.frontend.async_engine import AsyncEngine
    from pagedserve.engine.core.engine_core import EngineCore

    return AsyncEngine((core_factory or EngineCore)(config), log_requests=log_requests)
