"""The fault tests' seam: an engine core whose step raises for chosen requests, as a kernel or
sampler bug would, or one that is slow on every CPU, and ``serve`` with it.

``Poisoned(stage, prefix)`` is a core factory (``Engine(config, core_factory=...)``,
``spawn_core_process(..., core_factory=...)``, ``run_serve(args, core_factory=...)``): any step
whose ``stage`` (``execute`` or ``sample``) batches a request whose id starts with ``prefix``
raises there. It is picklable and light (the core, and torch with it, is imported only when it
is called, in the core's own process), so a served front end still never loads torch.

``Paced(step_s)``: every model step takes ``step_s`` longer (the core sleeps before it), so a
long stream lasts as long on a fast CPU as on a slow one: the gateway's seat tests hold a seat with
one, where the tiny model's 4,000 tokens took 2.3 s on a Zen 5 and ended before the test did.

``python -m tests.helpers.faults STAGE PREFIX <pagedserve serve arguments>`` serves with
``Poisoned``; ``python -m tests.helpers.faults paced STEP_S <...>`` with ``Paced``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.core.engine_core import EngineCore


class InjectedFault(RuntimeError):
    """What a poisoned step raises."""


@dataclass(frozen=True)
class Poisoned:
    stage: str  # "execute" or "sample"
    prefix: str

    def __call__(self, config: EngineConfig) -> EngineCore:
        from pagedserve.engine.core.engine_core import EngineCore

        stage, prefix = self.stage, self.prefix

        class PoisonedCore(EngineCore):
            def _fault_point(self, where, seqs):  # type: ignore[no-untyped-def]
                if where == stage:
                    hit = next((s for s in seqs if s.request.request_id.startswith(prefix)), None)
                    if hit is not None:
                        raise InjectedFault(f"injected {where} fault for request {hit.request.request_id}")

        return PoisonedCore(config)


@dataclass(frozen=True)
class Paced:
    step_s: float

    def __call__(self, config: EngineConfig) -> EngineCore:
        from pagedserve.engine.core.engine_core import EngineCore

        step_s = self.step_s

        class PacedCore(EngineCore):
            def _fault_point(self, where, seqs):  # type: ignore[no-untyped-def]
                if where == "execute":
                    time.sleep(step_s)  # a slower model, not a wait for anything

        return PacedCore(config)


def main(argv: list[str]) -> int:
    from pagedserve.cli import build_parser
    from pagedserve.server.cli import run_serve

    first, second, *serve_args = argv
    factory = Paced(float(second)) if first == "paced" else Poisoned(first, second)
    args = build_parser("serve").parse_args(["serve", *serve_args])
    return run_serve(args, core_factory=factory)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
