"""The engine: a core that steps token ids, and the front ends that drive it.

* :mod:`pagedserve.engine.core` — what the engine core process runs (or a thread of the server
  with ``--no-engine-process``); it never sees text.
* :mod:`pagedserve.engine.frontend` — the clients the servers hold, text in and out, the offline ``LLM``.
* :mod:`pagedserve.engine.wire` — what crosses between them; ``outputs``, ``sampling_params``,
  ``block_map`` and ``args`` are the types and flags both sides and the servers share.

This package's names are the door the servers (``server/``, ``ray_serve/``, ``gateway/``) use:
the client interface, the factory that starts a core and connects a client, and the types. None
of them imports torch; ``LLM`` and ``Engine`` (which do) load on first use.
"""

from pagedserve.engine.frontend import factory
from pagedserve.engine.frontend.client import EngineClient, EngineDeadError, LoadReport, RequestFailed, RequestStream
from pagedserve.engine.frontend.factory import (CoreFactory, CoreLaunch, CoreLink, CoreProcess, CoreRestarter,
                                                EngineStartupError, connect, core_restarter, describe_exit,
                                                die_with_parent, in_process, spawn_core_process)
from pagedserve.engine.outputs import CompletionOutput, EngineStats, RequestOutput, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["CompletionOutput", "CoreFactory", "CoreLaunch", "CoreLink", "CoreProcess", "CoreRestarter", "Engine",
           "EngineClient", "EngineDeadError", "EngineStartupError", "EngineStats", "LLM", "LoadReport",
           "RequestFailed", "RequestOutput", "RequestStream", "SamplingParams", "StructuredOutputsParams",
           "TokenLogprob", "connect", "core_restarter", "describe_exit", "die_with_parent", "factory", "in_process",
           "spawn_core_process"]


def __getattr__(name: str):
    # The offline LLM and the synchronous Engine hold a core in this process: torch loads with them.
    if name in ("LLM", "Engine"):
        from pagedserve.engine.frontend.engine import Engine
        from pagedserve.engine.frontend.llm import LLM

        return {"LLM": LLM, "Engine": Engine}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
