"""Building a model's modules on the meta device with no random initialization: on meta, torch
computes initial values through its Python reference ops, whose first use imports
``torch._dynamo`` (2.7 s of CPU in every engine start), for weights a checkpoint replaces anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _SkipInit(TorchFunctionMode):
    """Every ``torch.nn.init`` call returns its tensor untouched; anything else runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def meta_without_init() -> Iterator[None]:
    """Modules built inside get meta tensors and no initialization (the caller fills every one)."""
    with torch.device("meta"), _SkipInit():
        yield
