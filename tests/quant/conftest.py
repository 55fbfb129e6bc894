"""One torch thread for this directory's tests (tests/conftest.py's ``one_torch_thread``)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread_here(one_torch_thread: None) -> None:
    """Every test here takes the shared fixture."""
