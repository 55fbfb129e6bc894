"""The Triton kernel tests run on CUDA tensors where a GPU is present, and otherwise on CPU tensors
under Triton's interpreter: ``triton.jit`` decides between the two when a kernel is defined, so
``TRITON_INTERPRET`` is set by the root conftest (tests/conftest.py), before anything imports
Triton. (A GPU machine runs the same tests compiled, plus the bf16 and fp8-write ones the
interpreter cannot check.)"""

from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()

gpu_only = pytest.mark.skipif(not ON_GPU, reason="bf16 compute and fp8 writes are checked on a GPU only: Triton's "
                                                 "interpreter does not round them as the card does")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
