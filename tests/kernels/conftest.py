"""Fixtures shared by the native kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Runs the test with torch's intra-op pool at 1 and at 2 threads (the kernels split work over it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
