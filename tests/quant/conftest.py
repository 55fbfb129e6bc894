"""One torch thread for this directory's tests: their ops are tiny, and on a shared 2-core machine
two threads were measured ~25x slower per engine step (each op waits for a descheduled worker)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
