"""Whether the Triton kernels can run here, asked without importing them (or Triton, when it is absent)."""

from __future__ import annotations

import importlib.util

import torch

INSTALL_HINT = "pip install 'pagedserve[triton]'"
# The --kv-cache-dtype values whose pools the kernels read and write (pools.FORMATS; auto = float);
# int4 (kv/int4.py: per-channel key blocks, float16 tails) has no kernel.
TRITON_KV_DTYPES = ("auto", "int8", "fp8")


def triton_unavailable(device: torch.device) -> str | None:
    """Why the triton backend cannot run on ``device``, or ``None`` if it can.

    On CUDA it needs Triton installed. On CPU it runs only under Triton's interpreter (the
    tests set ``TRITON_INTERPRET=1`` before importing Triton): compiled Triton has no CPU target.
    """
    if importlib.util.find_spec("triton") is None:
        return f"Triton is not installed ({INSTALL_HINT})"
    if device.type == "cuda":
        return None
    import triton

    if device.type == "cpu" and triton.knobs.runtime.interpret:
        return None
    return f"the Triton kernels run on CUDA devices, not {device.type} (on CPU only under Triton's interpreter)"
