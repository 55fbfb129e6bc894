"""A circuit breaker: stop calling a store that keeps failing, probe it again after a pause."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CircuitBreaker:
    """Closed → (``failure_threshold`` failures in a row) → open → (``reset_s`` later) → half-open.

    While open, :meth:`allow` says no at once, so a dead store costs requests nothing but a
    decision; after ``reset_s`` one call at a time is let through as a probe, and its success
    closes the breaker again — recovery needs no restart.
    """

    failure_threshold: int = 3
    reset_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    opened_at: float | None = None
    _probing: bool = field(default=False, repr=False)

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open``."""
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.reset_s else "open"

    def allow(self) -> bool:
        """Whether a call may go to the store now (half-open lets one probe through at a time)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def record_success(self) -> None:
        """A call answered: close the breaker."""
        self.failures = 0
        self.opened_at = None
        self._probing = False

    def record_failure(self) -> bool:
        """A call failed; returns True when this failure opened (or re-opened) the breaker."""
        self.failures += 1
        self._probing = False
        if self.opened_at is not None or self.failures >= self.failure_threshold:
            self.opened_at = self.clock()
            return True
        return False
