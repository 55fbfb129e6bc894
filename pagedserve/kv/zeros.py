"""All-zero KV pools that cost nothing until they are used.

``torch.zeros`` writes every byte of a pool up front: the tiny model's default 1 GiB pool took a
second and more of CPU at every engine start (much more wall time on a machine short of memory),
and made the whole GiB resident though a test touches a few blocks of it. On CPU a pool is
instead laid over fresh anonymous memory (``mmap``), which the kernel hands out already zeroed,
page-aligned, one page at a time on first touch. Other devices keep ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous all-zero tensor; on CPU its memory is committed only as it is written or read."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive (frombuffer holds a reference); freeing it unmaps it.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
