"""Waiting on a condition with a bound, in place of a fixed sleep that stands in for "it has happened"."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition",
               interval: float = 0.01) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; fail the test if it
    has not within ``timeout`` seconds (``what`` names it in the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)
