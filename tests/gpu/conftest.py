"""The Triton kernel tests run on CUDA tensors where a GPU is present, and otherwise on CPU tensors
under Triton's interpreter: ``triton.jit`` decides between the two when a kernel is defined, so
``TRITON_INTERPRET`` is set here, before any test module imports the kernels. (A GPU machine runs
the same tests compiled, plus the bf16 and fp8-write ones the interpreter cannot check.)"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

gpu_only = pytest.mark.skipif(not ON_GPU, reason="bf16 compute and fp8 writes are checked on a GPU only: Triton's "
                                                 "interpreter does not round them as the card does")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
